"""
What the result-log summary costs the reactor thread, in process: per relayed chunk, and at
the end of a stream (``python -m bench.summary_cost``).

A streamed chat answer of 1 KiB, 64 KiB and 512 KiB (vLLM-shaped events of ~250 bytes, one
HTTP chunk each, ending with a ``usage`` event) is fed to a
:class:`~txlb._records.record.RequestRecord` as the proxy feeds it -- each read one chunk
in the backend's chunked framing, which the relay passes through -- then summarised:

* **one-shot** -- the summary as txlb made it before it summarised streams as they pass
  (``txlb/_records/summary.py`` at ``--against``, default the last commit before): every
  chunk kept, the whole capture de-chunked and parsed when the stream ends;
* **as chunks pass, result log on** (``Needs.TEXTS``): each event parsed and folded in as
  it comes; the end parses what is left of the last line;
* **as chunks pass, no result log** (``Needs.USAGE``): events split but only a handful
  parsed, at the end.

Printed: µs per chunk of capture, and the end-of-stream summary in ms (the stall every
other stream waits out), the median of 25 runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from txlb._records import summary as new
from txlb._records.needs import Needs

ROOT = Path(__file__).resolve().parent.parent
#: the last commit whose summary read a stream in one go at its end
BEFORE = "84cc65e"
SIZES = (1024, 64 * 1024, 512 * 1024)
TEXT = "word " * 8


def event(index: int) -> bytes:
    """One vLLM-shaped chat.completion.chunk event of about 250 bytes."""
    body = {"id": "chatcmpl-5c3e9a1f0b2d4e6f8a7b9c0d1e2f3a4b", "object": "chat.completion.chunk",
            "created": 1733100000, "model": "Qwen/Qwen2.5-7B-Instruct",
            "choices": [{"index": 0, "delta": {"content": TEXT[: 8 + index % 24]},
                         "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def answer(size: int) -> list[bytes]:
    """
    A stream of about ``size`` bytes, one event a chunk in chunked framing, ending as
    vLLM's does.
    """
    chunks: list[bytes] = []
    total = 0
    while total < size:
        chunks.append(event(len(chunks)))
        total += len(chunks[-1])
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": len(chunks),
                                      "total_tokens": 31 + len(chunks)}}
    chunks += [b"data: " + json.dumps(end).encode() + b"\n\n",
               b"data: " + json.dumps(usage).encode() + b"\n\n", b"data: [DONE]\n\n"]
    return [b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks] + [b"0\r\n\r\n"]


def load_before(revision: str) -> ModuleType:
    """``txlb/_records/summary.py`` as it was at ``revision``, as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show",
                             f"{revision}:txlb/_records/summary.py"],
                            check=True, capture_output=True).stdout
    path = Path(tempfile.mkdtemp()) / "summary_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("summary_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(module: ModuleType, needs: Needs | None) -> Any:
    extra = {} if needs is None else {"needs": needs}
    return module.RequestRecord(
        started=0.0, method=b"POST", path=b"/v1/chat/completions", orid_header=None,
        request_body=b'{"model": "m", "stream": true, "max_tokens": 4096}',
        backend="127.0.0.1:8000", status=200, ended=1.0, first_byte=0.01,
        content_type=b"text/event-stream", chunked=True, **extra)


def measure(module: ModuleType, needs: Needs | None, chunks: list[bytes],
            repeat: int) -> tuple[float, float]:
    """(µs per chunk captured, ms for the end-of-stream summary), medians."""
    per_chunk, at_end = [], []
    for _ in range(repeat):
        record = make(module, needs)
        capture: Callable[[bytes], None] = record.capture
        started = time.perf_counter()
        for chunk in chunks:
            capture(chunk)
        fed = time.perf_counter()
        module.summarize(record)
        ended = time.perf_counter()
        per_chunk.append((fed - started) / len(chunks) * 1e6)
        at_end.append((ended - fed) * 1e3)
    return statistics.median(per_chunk), statistics.median(at_end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=BEFORE,
                        help="the revision whose one-shot summary is compared (git)")
    parser.add_argument("--repeat", type=int, default=25, help="runs of each (the median)")
    options = parser.parse_args(argv)
    before = load_before(options.against)
    rows = [("one-shot (before)", before, None),
            ("as chunks pass, result log on", new, Needs.TEXTS),
            ("as chunks pass, no result log", new, Needs.USAGE)]
    print("| streamed answer | summary | capture µs/chunk | end of stream, ms |")
    print("|---|---|---:|---:|")
    for size in SIZES:
        chunks = answer(size)
        for name, module, needs in rows:
            chunk_us, end_ms = measure(module, needs, chunks, options.repeat)
            print(f"| {size // 1024} KiB ({len(chunks)} chunks) | {name} | "
                  f"{chunk_us:.2f} | {end_ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
