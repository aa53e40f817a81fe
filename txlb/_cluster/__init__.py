"""
The cluster: each backend's state, the pool that owns it, active health checks, hung-engine
detection, engine metrics and the in-flight counts shared across workers.
"""
