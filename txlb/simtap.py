"""
``twistd -n vllm-sim``: run :class:`txlb.testing.SimulatedVLLM` as a server.

For demos and manual testing of the balancer without a GPU, e.g. two backends::

    twistd -n --pidfile= vllm-sim --port 8002 --model m
    twistd -n --pidfile= vllm-sim --port 8003 --model m --tokens-per-second 20

and one with a prefix cache of 512 blocks whose prefill runs at 2,000 tokens/s::

    twistd -n --pidfile= vllm-sim --port 8004 --kv-cache-blocks 512 --prefill-rate 2000

The plugin registration lives in ``twisted/plugins/txlb_llmlb.py``; this module only holds
the options and the service factory, so importing the plugin stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from twisted.application import strports
from twisted.application.internet import StreamServerEndpointService
from twisted.internet.interfaces import IProtocolFactory, IReactorTime
from twisted.python import usage

from txlb.testing.engine import SimulatedVLLM

__all__ = ["Options", "makeService", "simulator_from_options"]

_T = TypeVar("_T", int, float)


def _endpoint_description(port: str) -> str:
    """
    A bare port number means loopback only: a simulator exposed on every interface by
    accident would be a surprise, while any endpoint string still allows it on purpose.
    """
    if port.isdigit():
        number = int(port)
        if number > 65535:
            raise usage.UsageError(f"--port: {port} is not a valid TCP port number")
        return f"tcp:{number}:interface=127.0.0.1"
    return port


class Options(usage.Options):
    """Command-line options of ``twistd vllm-sim``; each maps to a SimulatedVLLM argument."""

    synopsis = "[options]"
    longdesc = (
        "Serve a simulated vLLM OpenAI-compatible API (/health, /v1/models, /metrics, "
        "/v1/chat/completions, /v1/completions) that generates deterministic tokens at a "
        "configurable speed, for demos and tests of the load balancer."
    )
    optParameters = [
        [
            "port",
            "p",
            "8002",
            "Port number (listens on 127.0.0.1) or a Twisted server endpoint string.",
        ],
        ["tokens-per-second", None, "50", "Decode speed of each generation."],
        ["ttft", None, "0.05", "Time to first token, in seconds."],
        ["max-num-seqs", None, "256", "Generations running at once; the rest queue."],
        ["default-tokens", None, "16", "Tokens generated when max_tokens is not given."],
        ["max-model-len", None, "4096", "Context length of the simulated model."],
        ["reasoning-tokens", None, "4", "Reasoning tokens emitted when thinking is on."],
        [
            "kv-cache-blocks",
            None,
            "0",
            "KV-cache blocks of the prefix cache (0: no prefix cache). With a cache, a prompt "
            "counts one token per 4 characters and usage reports cached_tokens.",
        ],
        ["block-size", None, "16", "Tokens per KV-cache block (vLLM's default: 16)."],
        [
            "prefill-rate",
            None,
            "0",
            "Prompt tokens prefilled per second: time to first token is --ttft plus the "
            "uncached prompt tokens over this (0: no prefill time).",
        ],
        [
            "batch-slowdown",
            None,
            "0",
            "Decode slowdown of a full batch, 0 to <1: each generation decodes at "
            "tokens-per-second x (1 - this x running / max-num-seqs).",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["model"] = []

    def opt_model(self, name: str) -> None:
        """Served model name; repeat for several (default: sim-model)."""
        self["model"].append(name)

    opt_m = opt_model

    def _number(
        self, option: str, kind: Callable[[str], _T], check: Callable[[_T], bool], rule: str
    ) -> _T:
        raw = self[option]
        try:
            value = kind(raw)
        except (TypeError, ValueError):
            raise usage.UsageError(f"--{option} must be {rule}, got {raw!r}") from None
        if not check(value):
            raise usage.UsageError(f"--{option} must be {rule}, got {raw!r}")
        return value

    def postOptions(self) -> None:
        """Convert and check everything now, so mistakes fail before twistd daemonises."""
        self["tokens-per-second"] = self._number(
            "tokens-per-second", float, lambda v: 0 < v < float("inf"), "a positive number"
        )
        self["ttft"] = self._number(
            "ttft", float, lambda v: 0 <= v < float("inf"), "a non-negative number"
        )
        self["max-num-seqs"] = self._number(
            "max-num-seqs", int, lambda v: v >= 1, "a positive integer"
        )
        self["default-tokens"] = self._number(
            "default-tokens", int, lambda v: v >= 0, "a non-negative integer"
        )
        self["max-model-len"] = self._number(
            "max-model-len", int, lambda v: v >= 1, "a positive integer"
        )
        self["reasoning-tokens"] = self._number(
            "reasoning-tokens", int, lambda v: v >= 0, "a non-negative integer"
        )
        self["kv-cache-blocks"] = self._number(
            "kv-cache-blocks", int, lambda v: v >= 0, "a non-negative integer"
        )
        self["block-size"] = self._number("block-size", int, lambda v: v >= 1, "a positive integer")
        self["prefill-rate"] = self._number(
            "prefill-rate", float, lambda v: v >= 0, "a non-negative number (0: no prefill time)"
        )
        self["batch-slowdown"] = self._number(
            "batch-slowdown", float, lambda v: 0 <= v < 1, "a number from 0 up to (not including) 1"
        )
        if not self["model"]:
            self["model"] = ["sim-model"]
        description = _endpoint_description(str(self["port"]))
        from twisted.internet import endpoints, reactor

        try:
            endpoints.serverFromString(reactor, description)
        except (ValueError, TypeError, KeyError) as e:
            raise usage.UsageError(f"--port: invalid endpoint {description!r}: {e}") from None
        self["endpoint"] = description


def simulator_from_options(options: Options, reactor: IReactorTime) -> SimulatedVLLM:
    """The simulator ``options`` describe; separate from makeService so tests can check it."""
    return SimulatedVLLM(
        reactor,
        models=tuple(options["model"]),
        tokens_per_second=options["tokens-per-second"],
        ttft=options["ttft"],
        max_num_seqs=options["max-num-seqs"],
        default_tokens=options["default-tokens"],
        max_model_len=options["max-model-len"],
        reasoning_tokens=options["reasoning-tokens"],
        kv_cache_blocks=options["kv-cache-blocks"],
        block_tokens=options["block-size"],
        prefill_tokens_per_second=options["prefill-rate"],
        batch_slowdown=options["batch-slowdown"],
    )


def makeService(options: Options) -> StreamServerEndpointService:
    """Called by twistd: the simulator's site, listening on ``--port``."""
    from twisted.internet import reactor

    sim = simulator_from_options(options, cast(Any, reactor))
    return strports.service(options["endpoint"], cast(IProtocolFactory, sim.site()))
