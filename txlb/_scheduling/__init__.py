"""
Scheduling: which backend a request goes to -- the router (model routes, queueing at the caps),
session affinity, rate limits, the selection policies (one module each behind a registry,
``policies/``) and what a request is routed by (``request.RoutingRequest``).
"""
