"""
What resuming a stream costs, in process (``python -m bench.resume_cost``).

* **kept, never resumed** -- what every resumable stream pays while it relays: each chunk
  appended to the bytes kept for a resume (the exchange's one ``bytearray +=`` and length
  check a chunk), per chunk, against the same loop without it;
* **the resume** -- the one-off work when the engine fails: the kept stream read back
  (:func:`~txlb._resume.progress.read_progress`) and the continuation's body made, for
  streams of 100, 1,000 and 2,000 events;
* **rewriting the continuation** -- per event of the continuation, what only a resumed
  stream pays: each event parsed, given the first try's id, and written again
  (:class:`~txlb._resume.rewrite.ContinuationRewriter`).

vLLM-shaped events of ~250 bytes, one HTTP chunk each.  The median of 25 runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from txlb._resume.continuation import continuation_body
from txlb._resume.progress import read_progress
from txlb._resume.rewrite import ContinuationRewriter

RUNS = 25


def event(n: int, ident: str = "chatcmpl-4f1c0d2e9a8b7c6d5e4f3a2b1c0d9e8f") -> bytes:
    body = {"id": ident, "object": "chat.completion.chunk", "created": 1764806400,
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "choices": [{"index": 0, "delta": {"content": f" word{n}"}, "logprobs": None,
                         "finish_reason": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def median_seconds(work: Callable[[], object]) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    chunks = [framed(event(n)) for n in range(2000)]
    sink: list[bytes] = []

    def relay_plain() -> None:
        write = sink.append
        for chunk in chunks:
            write(chunk)
        sink.clear()

    def relay_kept() -> None:
        write = sink.append
        relayed = bytearray()
        for chunk in chunks:
            if relayed is not None:
                relayed += chunk
                if len(relayed) > 512 * 1024:
                    relayed = None
            write(chunk)
        sink.clear()

    plain = median_seconds(relay_plain) / len(chunks) * 1e6
    kept = median_seconds(relay_kept) / len(chunks) * 1e6
    print(f"kept, never resumed: {kept - plain:.3f} µs a chunk more "
          f"({kept:.3f} against {plain:.3f} µs for the loop alone)")
    payload = {"model": "m", "stream": True, "max_tokens": 4096,
               "messages": [{"role": "user", "content": "write a long story"}]}
    for count in (100, 1000, 2000):
        relayed = b"".join(chunks[:count])
        seconds = median_seconds(lambda r=relayed: continuation_body(
            payload, True, read_progress(r, True, True)))
        print(f"the resume of a stream of {count:>5} events: {seconds * 1e3:.2f} ms, once")
    progress = read_progress(b"".join(chunks[:100]), True, True)
    continuation = [event(n, "chatcmpl-other") for n in range(2000)]
    out: list[bytes] = []

    def rewrite() -> None:
        rewriter = ContinuationRewriter(progress, True, out.append)
        for data in continuation:
            rewriter.feed(data)
        out.clear()

    per_event = median_seconds(rewrite) / len(continuation) * 1e6
    print(f"rewriting the continuation: {per_event:.2f} µs an event (resumed streams only)")


if __name__ == "__main__":
    main()
