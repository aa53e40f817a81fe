"""
The records: what one finished request amounts to (summary), the result log and its formats,
and the Prometheus metrics.
"""
