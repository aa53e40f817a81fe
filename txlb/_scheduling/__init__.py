"""
Scheduling: which backend a request goes to -- the router (model routes, queueing at the caps),
session affinity, rate limits and the selection policies.
"""
