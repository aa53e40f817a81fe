"""
The proxy: the resource that admits each request (resource), txlb's own answers (local), the
exchange that forwards one request with failover and relays the answer (exchange), the pure
head translation between client and backend (head, headers), and the failure table that says
how each failure ends (failures).
"""
