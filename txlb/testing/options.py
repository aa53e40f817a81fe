"""
The checks :class:`~txlb.testing.SimulatedVLLM`'s options pass through, so a wrong value
fails where the simulator is made rather than at its first request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs


def to_models(value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    models = tuple(value)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"models must be a non-empty sequence of names, got {value!r}")
    return models


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}")


def count(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")
