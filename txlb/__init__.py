"""
txlb: a load balancer for LLM inference servers, built on Twisted.

A standard reverse proxy in everything a client can see, LLM-aware behind it:
least-connections scheduling, health checks that catch a dead engine behind a live API
server, SSE relayed chunk by chunk with backpressure, and client disconnects that abort the
generation upstream.
"""

from ._backend import Backend, Lease, Pool
from ._balancer import LoadBalancer
from ._config import BackendSpec, Config, ConfigError, build_config
from ._policies import IPolicy, LeastConnections

__all__ = [
    "Backend",
    "BackendSpec",
    "Config",
    "ConfigError",
    "IPolicy",
    "Lease",
    "LeastConnections",
    "LoadBalancer",
    "Pool",
    "build_config",
]
