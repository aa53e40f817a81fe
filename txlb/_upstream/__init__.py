"""
The upstream client: txlb's own HTTP/1.1 client for the hop to the backends, and the adapter
for an embedder's ``IAgent``.
"""
