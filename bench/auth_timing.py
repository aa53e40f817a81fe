"""
Whether the time ``--auth keys`` takes to refuse a key tells how close a guess came.

txlb never compares a guess with a stored key: it digests the presented key (SHA-256) and
looks the digest up in a dictionary.  This measures that path -- ``Tenants.identify`` on a
request carrying each kind of key -- for a tenant's real key, a wrong key of the same
length, a wrong key sharing all but its last character with the real one, a random short
key and no key at all, in alternating rounds (the machine is shared: every round is shown),
and reports each kind's median time per call as a ratio to the real key's.  A comparison
that leaked would show the near miss slower than the random key; a digest lookup shows
them equal within the noise.

``python -m bench.auth_timing`` writes bench/results/auth-timing.md.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

from twisted.internet.task import Clock
from twisted.web.test.requesthelper import DummyRequest

from bench.provenance import RESULTS
from txlb._cluster.local_store import LocalStore
from txlb._config import build_config
from txlb._config.keys_edit import new_key
from txlb._scheduling.tenants import Tenants

KINDS = ("real key", "same length", "near miss", "short random", "no key")


def requests(real: str) -> dict[str, DummyRequest]:
    """One request per kind of key."""
    made: dict[str, DummyRequest] = {}
    for kind, key in (("real key", real), ("same length", new_key()),
                      ("near miss", real[:-1] + ("A" if real[-1] != "A" else "B")),
                      ("short random", "sk-nope"), ("no key", None)):
        request = DummyRequest([b""])
        if key is not None:
            request.requestHeaders.setRawHeaders(b"authorization", [f"Bearer {key}".encode()])
        made[kind] = request
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=10000, help="keys in the keys file")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="txlb-auth-timing-"))
    keys = [new_key() for _ in range(args.keys)]
    entries = "".join(f'[[keys]]\nsha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
                      f'tenant = "t{n % 100}"\n' for n, k in enumerate(keys))
    path = directory / "keys.toml"
    path.write_text(entries)
    path.chmod(0o600)
    config = build_config({"backends": "127.0.0.1:9", "auth": "keys",
                           "keys-file": str(path)}, {})
    tenants = Tenants(config, LocalStore(), Clock())
    made = requests(keys[len(keys) // 2])
    assert tenants.identify(made["real key"]).name == "t0"  # type: ignore[union-attr]
    rounds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for number in range(args.rounds):
        order = KINDS if number % 2 == 0 else tuple(reversed(KINDS))
        for kind in order:
            request = made[kind]
            started = time.perf_counter()
            for _ in range(args.calls):
                tenants.identify(request)
            rounds[kind].append((time.perf_counter() - started) / args.calls * 1e9)
    base = statistics.median(rounds["real key"])
    lines = ["# The time a key's check takes, by how close the key is",
             "",
             f"`python -m bench.auth_timing --rounds {args.rounds} --calls {args.calls} "
             f"--keys {args.keys}`: `Tenants.identify` on a request with each kind of key, "
             f"{args.keys} keys in the file, {args.calls} calls a round, rounds alternating "
             "in order.  Nanoseconds per call, every round; the ratio is the median's to "
             "the real key's.",
             "",
             "| key | " + " | ".join(f"round {n + 1}" for n in range(args.rounds))
             + " | median | ratio |",
             "|---|" + "---|" * (args.rounds + 2)]
    for kind in KINDS:
        median = statistics.median(rounds[kind])
        lines.append(f"| {kind} | " + " | ".join(f"{v:.0f}" for v in rounds[kind])
                     + f" | {median:.0f} | {median / base:.2f} |")
    near, random = (statistics.median(rounds[k]) for k in ("near miss", "same length"))
    lines += ["", f"A near miss (all but the last character right) against a random key of "
                  f"the same length: {near / random:.2f}x.  The check digests the key and "
                  "probes a dictionary: no step compares a guess with a key, so how much of "
                  "a guess is right cannot change its time.  A request without a key is "
                  "refused before any digest (cheaper, and it says nothing of any key); a "
                  "wrong key costs more than a right one by the refusal it builds, the "
                  "same for every wrong key."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "auth-timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
