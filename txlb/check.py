"""
``python -m txlb.check [lb.toml] [options]``: validate a configuration without starting.

The config is built exactly as ``twistd -n llmlb`` would build it -- the file, the options
given here, the environment, the defaults -- and nothing is started, listened on or
connected to.  It prints ``OK: lb.toml (3 backends, policy least-conn)`` and exits 0, or
prints the one line start-up would refuse with and exits 2: ``nginx -t`` for txlb, to run
before ``kill -HUP`` (or ``POST /reload``) so a typo never reaches a running balancer.
``twistd -n llmlb --check [options]`` is the same check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from twisted.python import usage

from txlb._verdict import verdict
from txlb.tap import Options


def main(argv: Sequence[str] | None = None) -> int:
    """Check the config named by ``argv`` (a file first, then any options); the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args[:1] = ["--config", args[0]]
    options = Options()
    try:
        options.parseOptions(args)
    except usage.UsageError as error:
        sys.stderr.write(f"txlb: error: {error}\n")
        return 2
    sys.stdout.write(verdict(options.config, options.source.path) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess
    raise SystemExit(main())
