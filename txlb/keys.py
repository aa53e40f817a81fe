"""
``python -m txlb.keys TENANT [--label LABEL] [--add KEYS_FILE]``: make a new API key.

Prints the key on standard error -- the one time it is ever shown: txlb keeps only its
SHA-256 -- and on standard output the ``[[keys]]`` entry of the keys file (``--keys-file``)
that admits it as ``TENANT``, so ``python -m txlb.keys search >> keys.toml`` adds the entry
and never the key.  With
``--add``, the entry is appended to that keys file (atomically, mode 0600) instead of
printed; a running balancer takes it on its next reload (``kill -HUP``, ``POST /reload``),
as the admin API's ``POST /tenants/keys`` does in one step.

``python -m txlb.keys --digest`` reads a key on standard input and prints its SHA-256: the
entry of a key made elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence

from txlb._config.errors import ConfigError
from txlb._config.keys_edit import add_key, key_entry, new_key


def main(argv: Sequence[str] | None = None) -> int:
    """Make a key (or digest one); the exit code."""
    parser = argparse.ArgumentParser(prog="python -m txlb.keys", description=__doc__.split(
        "\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tenant", nargs="?", help="the tenant the key admits")
    parser.add_argument("--label", default="", help="shown by the admin API in its place")
    parser.add_argument("--add", metavar="KEYS_FILE", help="append the entry to this file")
    parser.add_argument("--digest", action="store_true",
                        help="print the SHA-256 of a key read on standard input")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.digest:
        key = sys.stdin.readline().strip().encode("utf-8")
        if not key:
            sys.stderr.write("txlb.keys: no key on standard input\n")
            return 2
        sys.stdout.write(hashlib.sha256(key).hexdigest() + "\n")
        return 0
    if not args.tenant:
        parser.print_usage(sys.stderr)
        return 2
    key = new_key()
    digest = hashlib.sha256(key.encode("ascii")).hexdigest()
    try:
        entry = key_entry(digest, args.tenant, args.label)
        if args.add:
            add_key(args.add, digest, args.tenant, args.label)
    except ConfigError as error:
        sys.stderr.write(f"txlb.keys: {error}\n")
        return 2
    sys.stderr.write(f"the key of tenant {args.tenant}, shown this once (txlb keeps only "
                     f"its SHA-256):\n{key}\n")
    if args.add:
        sys.stderr.write(f"added to {args.add} (id {digest[:8]}); reload txlb to use it\n")
    else:
        sys.stdout.write(entry)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess
    raise SystemExit(main())
