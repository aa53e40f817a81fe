"""
How long the result log's two formats take per line: ``python -m bench.formats``.

Both formatters run once per finished request, in the process that writes the log (the
supervisor, under ``--workers``, formats every worker's lines), so a slower formatter is
a lower ceiling for the whole balancer.  The summaries are a representative mix: streamed
completions with a preview, errors with request keys and a body, embeddings, other paths,
some with the optional fields (``end=``, ``tries=``, ``trunc=``) and some with text that
needs escaping.

``--dump FILE`` writes every line of both formats for a larger, seeded variety of
summaries instead, so two versions of the formatters can be compared byte for byte.
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from typing import Any

from txlb._records.resultlog import format_json, format_text
from txlb._records.summary import Summary

_TEXTS = ["", "Hello there", "图片显示一位年长的男性", "line\nbreak", "tab\tand\x1b[31m",
          "a\u2028b", "x=1 | y", "back\\slash", "\ud800 lone", "emoji 🎉", "\x7f\x85"]
_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/chat/completions",
          "/v1/embeddings", "/v1/models", "/weird path=|x"]


def representative() -> list[Summary]:
    """The timed mix: mostly completions, as in a fleet serving chat."""
    completion = Summary(time=1764426121.5, orid="ORD-123", backend="127.0.0.1:8003",
                         method="POST", path="/v1/chat/completions", status=200,
                         kind="completion", outcome="ok", dur=6.913, ttft=0.212,
                         finish="stop", completion_tokens=432, max_tokens=1024,
                         thinking=False, think=True, empty=False, clen=2107,
                         preview="图片显示一位年长的男性，" * 16)
    messages = Summary(time=1764426122.5, orid="alice", backend="127.0.0.1:8004",
                       method="POST", path="/v1/messages", status=200, kind="completion",
                       outcome="client_abort", dur=1.5, ttft=0.3, finish=None,
                       completion_tokens=None, max_tokens=256, preview="Hello\nworld " * 10,
                       tries=2)
    error = Summary(time=1764426123.5, orid="905112", backend="127.0.0.1:8005",
                    method="POST", path="/v1/chat/completions", status=400, kind="error",
                    outcome="ok", dur=0.004,
                    req_keys=["max_tokens", "messages", "model", "stream", "temperature"],
                    err_body='{"object":"error","message":"This model\'s maximum context '
                             'length is 4096 tokens."}')
    embedding = Summary(time=1764426124.5, orid="-", backend="127.0.0.1:8002",
                        method="POST", path="/v1/embeddings", status=200, kind="embedding",
                        outcome="ok", dur=0.013, count=2, prompt_tokens=11)
    other = Summary(time=1764426125.5, orid="-", backend="127.0.0.1:8002", method="GET",
                    path="/v1/models", status=200, kind="other", outcome="ok", dur=0.003,
                    truncated=True)
    return [completion] * 6 + [messages, error, embedding, other]


def variety(count: int, seed: int = 12) -> list[Summary]:
    """Seeded summaries that reach every branch of both formats."""
    rng = random.Random(seed)
    pick = rng.choice

    def maybe(value: Any) -> Any:
        return None if rng.random() < 0.3 else value

    summaries = []
    for _ in range(count):
        kind = pick(["completion", "error", "embedding", "other"])
        summaries.append(Summary(
            time=rng.uniform(0, 2e9), orid=pick(_TEXTS + ["-", "ORD-1"]),
            backend=pick(["127.0.0.1:8002", "[::1]:9", "-", ""]),
            method=pick(["GET", "POST", "P T"]),
            path=pick(_PATHS), status=pick([200, 400, 499, 503]), kind=kind,
            outcome=pick(["ok", "ok", "timeout", "client_abort", "upstream_error"]),
            dur=rng.uniform(0, 100), ttft=maybe(rng.uniform(0, 10)),
            finish=maybe(pick(_TEXTS)), completion_tokens=maybe(rng.randrange(0, 5000)),
            max_tokens=maybe(rng.randrange(1, 9000)), thinking=rng.random() < 0.5,
            think=rng.random() < 0.5, empty=rng.random() < 0.5, clen=rng.randrange(0, 9999),
            preview=pick(_TEXTS),
            req_keys=maybe([pick(_TEXTS) for _ in range(rng.randrange(4))]),
            err_body=pick(_TEXTS), truncated=rng.random() < 0.2, tries=pick([1, 1, 2, 3]),
            prompt_tokens=maybe(rng.randrange(0, 99)), count=maybe(rng.randrange(0, 9)),
            cached_prompt_tokens=maybe(rng.randrange(0, 99)),
            stream=rng.random() < 0.5,
        ))
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", help="write both formats of many summaries to this file")
    parser.add_argument("--lines", type=int, default=5000, help="summaries per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings; the best is kept")
    args = parser.parse_args()
    if args.dump:
        with open(args.dump, "w", encoding="utf-8", errors="backslashreplace") as out:
            for summary in variety(20000):
                out.write(format_text(summary) + "\n" + format_json(summary) + "\n")
        return
    mix = representative()
    summaries = (mix * (args.lines // len(mix) + 1))[:args.lines]
    for name, formatter in (("text", format_text), ("json", format_json)):
        def run(formatter: Any = formatter) -> None:
            for summary in summaries:
                formatter(summary)
        best = min(timeit.repeat(run, number=1, repeat=args.repeat))
        sys.stdout.write(f"{name}: {best / len(summaries) * 1e6:.2f} us per line\n")


if __name__ == "__main__":
    main()
