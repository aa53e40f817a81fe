"""
The configuration: one frozen :class:`Config` from the command line, the environment, a
TOML file and the defaults (see :mod:`txlb._config.config`).

Each module has one job -- the option table, the parsers by concern, the file reader, the
``Config`` itself -- and modules inside txlb import the one that defines a name.  This
package re-exports the public names for code outside txlb (tests, benchmarks, embedders),
imported on first use (PEP 562): importing a small module of the package, such as
:mod:`txlb._config.bounds` or :mod:`txlb._config.errors`, must not build the option table,
which reads the policy registry, which imports the policies that import those modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from txlb._config.backends import (
        MAX_ADDRESSES_PER_NAME,
        BackendSpec,
        DnsBackendSpec,
        parse_backend_address,
        parse_backends,
    )
    from txlb._config.classes import ClassSpec
    from txlb._config.config import Config, build_config
    from txlb._config.endpoints import is_loopback_endpoint, parse_listen
    from txlb._config.errors import ConfigError, closest_name, did_you_mean
    from txlb._config.hosts import is_host_name
    from txlb._config.limits import MAX_BUDGET_TOKENS, BudgetSpec, parse_budgets, token_digest
    from txlb._config.option import OptionSpec
    from txlb._config.routing import RouteSpec
    from txlb._config.shared import SharedStateSpec, parse_shared_state
    from txlb._config.table import OPTIONS
    from txlb._config.toml_file import MAX_CONFIG_BYTES, read_toml
    from txlb._config.values import parse_size

__all__ = [
    "MAX_ADDRESSES_PER_NAME",
    "MAX_BUDGET_TOKENS",
    "MAX_CONFIG_BYTES",
    "OPTIONS",
    "BackendSpec",
    "BudgetSpec",
    "ClassSpec",
    "Config",
    "ConfigError",
    "DnsBackendSpec",
    "OptionSpec",
    "RouteSpec",
    "SharedStateSpec",
    "build_config",
    "closest_name",
    "did_you_mean",
    "is_host_name",
    "is_loopback_endpoint",
    "parse_backend_address",
    "parse_backends",
    "parse_budgets",
    "parse_listen",
    "parse_shared_state",
    "parse_size",
    "read_toml",
    "token_digest",
]


def __getattr__(name: str) -> Any:
    """A public name, from the module that defines it (imported now, if not yet)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from txlb._config import (
        backends,
        classes,
        config,
        endpoints,
        errors,
        hosts,
        limits,
        option,
        routing,
        shared,
        table,
        toml_file,
        values,
    )

    for module in (config, errors, backends, classes, endpoints, hosts, limits, option,
                   routing, shared, table, toml_file, values):
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # pragma: no cover
