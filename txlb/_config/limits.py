"""
What a client may send: ``--rate-limit``'s rate and ``--rate-key``, and the token budgets
of ``[[budgets]]`` with ``--budget-completion-estimate``.

A budget names its clients as ``--rate-key`` keys them (a bearer token only by its
digest, never itself), so both are parsed here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from typing import Any

import attrs

from txlb._config.errors import ConfigError, did_you_mean
from txlb._config.values import parse_count

_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(option: str, value: object) -> float | None:
    """``N/s``, ``N/m`` or ``N/h`` (a bare number is per second); in requests per second."""
    text = str(value).strip().lower()
    if text in ("", "none"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:/\s*([smh]))?", text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--{option}: {value!r} is not a rate like '100/s' or '600/m'")
    return float(match.group(1)) / _RATE_UNITS[match.group(2) or "s"]


def parse_rate_key(option: str, value: object) -> str:
    text = str(value).strip()
    if text in ("ip", "token"):
        return text
    kind, _, name = text.partition(":")
    if kind.lower() != "header" or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
        raise ConfigError(f"--{option}: {value!r} is not 'ip', 'token' or 'header:NAME'")
    return f"header:{name}"


#: The windows a ``[[budgets]]`` entry may limit, by their key in the table, in seconds.
BUDGET_WINDOWS = {"tokens_per_minute": 60.0, "tokens_per_day": 86400.0}
_BUDGET_KEYS = ("name", "key", "value", "digest", "class", *BUDGET_WINDOWS)
#: Tokens a budget may hold at most: far above any fleet's day, far below float trouble.
MAX_BUDGET_TOKENS = 10**15
_BUDGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: a bearer token's digest as a budget's ``digest`` takes it: the sha256 in hex, as
#: ``printf %s "$KEY" | sha256sum`` prints it and ``[[classes]]`` ``keys`` take it (with an
#: optional ``sha256:`` in front), or its first 32 digits (what txlb keys clients by)
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64}|[0-9a-f]{32})")


def token_digest(token: str | bytes) -> str:
    """
    The digest ``--rate-key token`` keys a bearer token by (the token itself is never
    kept): the first 32 hex digits of its SHA-256.
    """
    raw = token.encode("utf-8") if isinstance(token, str) else token
    return hashlib.sha256(raw.strip()).hexdigest()[:32]


@attrs.frozen
class BudgetSpec:
    """
    A ``[[budgets]]`` entry: whose tokens it limits and how many per window.

    ``kind`` is a ``--rate-key`` kind (``ip``, ``token``, ``header:NAME``); ``key`` the one
    client key it limits (as :func:`txlb._scheduling.ratelimit.client_key` writes it:
    ``ip:10.0.0.7``, ``token:<digest>``, ``header:<digest of the value>``), or ``None``
    for every key of that kind, each with its own levels.  ``priority`` limits only requests of that
    priority class.  ``windows`` pairs each window's seconds with its tokens.
    """

    name: str
    kind: str
    key: str | None
    priority: str | None
    windows: tuple[tuple[float, int], ...]


def _budget_tokens(name: str, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"budgets.{field}: {value!r} of budget {name!r} is not a whole "
                          "number of tokens")
    if not 1 <= value <= MAX_BUDGET_TOKENS:
        raise ConfigError(f"budgets.{field}: {value!r} of budget {name!r} must be between "
                          f"1 and {MAX_BUDGET_TOKENS}")
    return value


def _budget_key(name: str, kind: str, item: dict[str, Any]) -> str | None:
    """The one client key a budget limits (a token only as its digest), or ``None``."""
    value, digest = item.get("value"), item.get("digest")
    if value is not None and digest is not None:
        raise ConfigError(f"budgets: budget {name!r} has both 'value' and 'digest'; "
                          "give one")
    if digest is not None:
        # as [[classes]] keys take it: any case, surrounding spaces ignored
        match = (_DIGEST.fullmatch(digest.strip().lower()) if isinstance(digest, str)
                 else None)
        if kind != "token" or match is None:
            raise ConfigError(f"budgets.digest: budget {name!r}: a digest goes with "
                              "key = 'token' and is the key's sha256 in hex "
                              "(printf %s \"$KEY\" | sha256sum)")
        return "token:" + match.group(1)[:32]
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > 1024:
        # the value itself is not echoed: with key = "token" it is a secret
        raise ConfigError(f"budgets.value: budget {name!r}: the value must be a non-empty "
                          "string of at most 1024 characters")
    if kind == "token":
        return "token:" + token_digest(value)
    if kind == "ip":
        try:
            address = ipaddress.ip_address(value.strip())
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped  # as a dual-stack listener's IPv4 client
            return "ip:" + str(address)
        except ValueError:
            raise ConfigError(f"budgets.value: {value!r} of budget {name!r} is not an IP "
                              "address") from None
    # as txlb.ratelimit.header_digest keys a request's header (bounded, whatever its size)
    return "header:" + hashlib.sha256(value.encode("utf-8")).hexdigest()[:32]


def parse_budgets(option: str, value: object) -> tuple[BudgetSpec, ...]:
    """
    The ``[[budgets]]`` tables (config file only): each one a name, whom it limits
    (``key``, and ``value`` or ``digest`` for one client, ``class`` for one priority
    class) and ``tokens_per_minute`` and/or ``tokens_per_day``.
    """
    if isinstance(value, tuple) and not value:
        return ()
    if not isinstance(value, list):
        raise ConfigError("budgets: not a list of [[budgets]] tables")
    budgets: list[BudgetSpec] = []
    names: set[str] = set()
    selectors: dict[tuple[str, str | None, str | None], str] = {}
    for item in value:
        if not isinstance(item, dict):
            raise ConfigError("budgets: an entry is not a table")
        unknown = sorted(set(item) - set(_BUDGET_KEYS))
        if unknown:
            raise ConfigError(f"budgets: unknown key {unknown[0]!r} in a [[budgets]] table"
                              f"{did_you_mean(unknown[0], _BUDGET_KEYS)}")
        name = item.get("name")
        if not isinstance(name, str) or not _BUDGET_NAME.fullmatch(name):
            raise ConfigError(f"budgets.name: {name!r} is not a name (letters, digits, "
                              "'_', '.', '-'; at most 64)")
        if name in names:
            raise ConfigError(f"budgets.name: {name!r} is used twice")
        names.add(name)
        if "key" not in item:
            raise ConfigError(f"budgets.key: budget {name!r} has no key ('ip', 'token' "
                              "or 'header:NAME')")
        if not isinstance(item["key"], str):
            raise ConfigError(f"budgets.key: {item['key']!r} of budget {name!r} is not "
                              "'ip', 'token' or 'header:NAME'")
        kind = parse_rate_key(f"budgets.key of {name!r}", item["key"])
        key = _budget_key(name, kind, item)
        priority = item.get("class")
        if priority is not None and (not isinstance(priority, str)
                                     or not _BUDGET_NAME.fullmatch(priority)):
            raise ConfigError(f"budgets.class: {priority!r} of budget {name!r} is not a "
                              "class name")
        windows = tuple((seconds, _budget_tokens(name, field, item[field]))
                        for field, seconds in BUDGET_WINDOWS.items() if field in item)
        if not windows:
            raise ConfigError(f"budgets: budget {name!r} limits nothing: give "
                              "tokens_per_minute, tokens_per_day or both")
        selector = (kind, key, priority)
        if selector in selectors:
            raise ConfigError(f"budgets: budget {name!r} limits the same clients as "
                              f"{selectors[selector]!r}; merge them into one")
        selectors[selector] = name
        budgets.append(BudgetSpec(name, kind, key, priority, windows))
    return tuple(budgets)


def parse_completion_estimate(option: str, value: object) -> int:
    """The completion tokens a budget assumes for a request that sets no maximum."""
    number = parse_count(option, value)
    if number > MAX_BUDGET_TOKENS:
        raise ConfigError(f"--{option}: {value!r} must be at most {MAX_BUDGET_TOKENS}")
    return number
