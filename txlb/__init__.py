"""
txlb: a load balancer for LLM inference servers, built on Twisted.

A standard reverse proxy in everything a client can see, LLM-aware behind it:
least-connections scheduling, health checks that catch a dead engine behind a live API
server, SSE relayed chunk by chunk with backpressure, and client disconnects that abort the
generation upstream.

The public names are imported on first use (PEP 562), so that importing a submodule --
notably the ``txlb-epoll`` reactor, which must be installed before anything imports
``twisted.internet.reactor`` -- does not drag in Klein and with it the default reactor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from txlb._version import __version__ as __version__

if TYPE_CHECKING:
    from txlb._balancer import LoadBalancer
    from txlb._cluster.backend import Backend
    from txlb._cluster.pool import Pool
    from txlb._cluster.slots import Lease
    from txlb._config.backends import BackendSpec
    from txlb._config.config import Config, build_config
    from txlb._config.errors import ConfigError
    from txlb._scheduling.outcome import RequestOutcome
    from txlb._scheduling.policies import (
        IPolicy,
        IPolicyFactory,
        IPreparesRequests,
        Policy,
        PolicyFactory,
    )
    from txlb._scheduling.policies.least_conn import LeastConnections
    from txlb._scheduling.request import RoutingRequest

_EXPORTS = {
    "Backend": "._cluster.backend",
    "Lease": "._cluster.slots",
    "Pool": "._cluster.pool",
    "LoadBalancer": "._balancer",
    "BackendSpec": "._config.backends",
    "Config": "._config.config",
    "ConfigError": "._config.errors",
    "build_config": "._config.config",
    "IPolicy": "._scheduling.policies",
    "IPolicyFactory": "._scheduling.policies",
    "IPreparesRequests": "._scheduling.policies",
    "Policy": "._scheduling.policies",
    "PolicyFactory": "._scheduling.policies",
    "LeastConnections": "._scheduling.policies.least_conn",
    "RequestOutcome": "._scheduling.outcome",
    "RoutingRequest": "._scheduling.request",
}

__all__ = [
    "Backend",
    "BackendSpec",
    "Config",
    "ConfigError",
    "IPolicy",
    "IPolicyFactory",
    "IPreparesRequests",
    "Lease",
    "LeastConnections",
    "LoadBalancer",
    "Policy",
    "PolicyFactory",
    "Pool",
    "RequestOutcome",
    "RoutingRequest",
    "build_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'txlb' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
