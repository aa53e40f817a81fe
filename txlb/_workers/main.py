"""
``python -m txlb._workers.main --index I [--reactor NAME]``: a worker process of ``twistd llmlb
--workers N``, started by its supervisor (txlb._workers.supervisor); the worker itself is
txlb._workers.worker.

This module only installs the reactor the supervisor runs (``--reactor txlb-epoll``
carries over) before anything imports Twisted's default one -- importing the balancer
does, through klein -- and then hands over.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--reactor" in args:
        from twisted.application.reactors import installReactor

        installReactor(args[args.index("--reactor") + 1])
    from txlb._workers.worker import main as run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
