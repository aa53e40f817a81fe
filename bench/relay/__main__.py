"""``python -m bench.relay``, the same as ``python -m bench relay`` (:mod:`bench.relay.run`)."""

from bench.relay.run import main

main()
