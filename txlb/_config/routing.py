"""
How a request finds its backend: ``--policy`` (the registry's names), ``--unknown-model``,
``--affinity`` and the ``[[routes]]`` model aliases.

``--policy`` is checked against the policy registry, built-in policies and plugins alike,
and its help lists what the registry knows when it is asked.
"""

from __future__ import annotations

import random
import re

import attrs
from twisted.internet.task import Clock

from txlb._config.errors import ConfigError
from txlb._scheduling.policies.registry import BUILT_IN, find_factory, policy_names


def parse_policy(option: str, value: object) -> str:
    """
    A policy the registry knows: a built-in one, or one a plugin provides.  A plugin's is
    made once here, on a stopped clock, so that one whose module is missing or whose
    factory makes no policy is the same one-line error as a misspelt name, not a
    traceback when the balancer starts.
    """
    text = str(value).strip().lower()
    factory = find_factory(text)
    if factory is None:
        raise ConfigError(f"--{option}: {value!r} is not one of {', '.join(policy_names())}")
    if factory not in BUILT_IN:
        try:
            factory(Clock(), random.Random())
        except Exception as error:
            raise ConfigError(f"--{option}: {value!r} is a plugin's policy that could not be "
                              f"made: {type(error).__name__}: {error}") from None
    return text


def describe_policies() -> str:
    """``--policy``'s help: every policy the registry knows now, plugins' included."""
    return f"Backend choice: {', '.join(policy_names())}."


UNKNOWN_MODEL = ("404", "forward")


def parse_unknown_model(option: str, value: object) -> str:
    """``404`` (as vLLM answers a model it does not serve) or ``forward`` (as nginx would)."""
    text = str(value).strip().lower()
    if text not in UNKNOWN_MODEL:
        raise ConfigError(f"--{option}: {value!r} is not '404' or 'forward'")
    return text


def parse_affinity(option: str, value: object) -> str | None:
    """``header:NAME``, ``user`` or ``none``."""
    text = str(value).strip()
    if text.lower() in ("none", ""):
        return None
    if text == "user":
        return text
    kind, _, name = text.partition(":")
    if kind.lower() != "header" or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
        raise ConfigError(f"--{option}: {value!r} is not 'header:NAME' or 'user'")
    return f"header:{name}"


@attrs.frozen
class RouteSpec:
    """A ``[[routes]]`` entry: clients ask for ``model``, backends get one of ``targets``."""

    model: str
    targets: tuple[tuple[str, int], ...]


def parse_routes(option: str, value: object) -> tuple[RouteSpec, ...]:
    if isinstance(value, tuple) and not value:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"routes: {value!r} is not a list of [[routes]] tables")
    routes = []
    seen: set[str] = set()
    for item in value:
        if not isinstance(item, dict):
            raise ConfigError(f"routes: {item!r} is not a table")
        unknown = sorted(set(item) - {"model", "to"})
        if unknown:
            raise ConfigError(f"routes: unknown key {unknown[0]!r} in {item!r}")
        model, targets = item.get("model"), item.get("to")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"routes.model: {model!r} is not a model name")
        if model in seen:
            raise ConfigError(f"routes.model: {model!r} is routed twice")
        seen.add(model)
        if not isinstance(targets, dict) or not targets:
            raise ConfigError(f"routes.to: {targets!r} is not a table of model = weight")
        pairs = []
        for target, weight in targets.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                raise ConfigError(f"routes.to: weight {weight!r} of {target!r} is not a "
                                  "whole number of at least 1")
            pairs.append((str(target), weight))
        routes.append(RouteSpec(model, tuple(pairs)))
    return tuple(routes)
