"""
The proxy: the resource that answers each request, the exchange that forwards it with failover,
and the head translation between client and backend.
"""
