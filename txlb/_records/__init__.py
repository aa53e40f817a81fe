"""
The records: what the proxy observes of each request (observer), the one bookkeeper that
counts it (bookkeeper), what one finished request amounts to (summary, outcome), the result
log and its formats, and the Prometheus metrics.
"""
