"""``python -m bench relay``: txlb against the balancers users would pick instead."""
