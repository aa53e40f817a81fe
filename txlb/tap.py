"""
``twistd llmlb``: command-line options and the service they build.

Every option defaults to ``None`` here so :func:`txlb._config.build_config` can tell "given
on the command line" from "not given" and apply the precedence rule
(command line > environment > config file > default).
"""

from __future__ import annotations

import sys

from twisted.application import strports
from twisted.application.service import IService, MultiService
from twisted.python import usage

from ._balancer import LoadBalancer
from ._config import OPTIONS, Config, ConfigError, build_config


def _describe(name: str) -> str:
    spec = next(s for s in OPTIONS if s.name == name)
    env = f" [env {spec.env}]" if spec.env else ""
    return f"{spec.help} Default: {spec.default}.{env}"


class Options(usage.Options):
    """The options of ``twistd llmlb``; see docs/usage.md for each one."""

    synopsis = "[options]"
    longdesc = (
        "Run the txlb load balancer in front of OpenAI-compatible inference servers. "
        "Every option can also come from its environment variable or from the TOML file "
        "given with --config (command line > environment > file > default)."
    )
    optParameters = [
        ["config", "c", None, "TOML config file. [env LB_CONFIG]"],
        *[[spec.name, None, None, _describe(spec.name)] for spec in OPTIONS],
    ]

    config: Config

    def postOptions(self) -> None:
        try:
            self.config = build_config({k: v for k, v in self.items()})
        except ConfigError as error:
            if getattr(self, "parent", None) is not None:
                # Under twistd/twist a UsageError dumps the whole usage text before the
                # error; an operator reading a failed unit's journal wants the one line.
                sys.stderr.write(f"txlb: error: {error}\n")
                raise SystemExit(2) from None
            raise usage.UsageError(str(error)) from None


def makeService(options: Options) -> IService:
    """The balancer's background services plus the listening port."""
    balancer = LoadBalancer(config=options.config)
    top = MultiService()
    balancer.service().setServiceParent(top)
    strports.service(options.config.listen, balancer.site()).setServiceParent(top)
    return top
