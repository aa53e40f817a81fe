"""
``--backends`` and ``--resolver``: the fleet as configured, fixed addresses and DNS names.

A backend is written as ``host:port``, ``http://host:port``, a TOML ``[[backends]]`` table
or a ``dns:NAME:PORT`` / ``srv:NAME`` entry resolved at run time; each is checked here,
once, for the command line, the environment, the config file and the admin API alike.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Collection, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs

from txlb._config.errors import ConfigError, did_you_mean
from txlb._config.hosts import is_address, is_host_name
from txlb._config.values import parse_count, parse_nonnegative_int


@attrs.frozen
class BackendSpec:
    """
    One backend as configured: where it is and how much work it may take.

    ``models`` empty means "learn them from the backend's ``/v1/models``".
    """

    host: str
    port: int
    weight: int = 1
    max_conns: int = 0
    models: tuple[str, ...] = ()
    #: the engine's own API key (``api_key``/``api_key_env``), sent as its bearer token in
    #: place of the client's; never shown, logged or compared in a repr
    api_key: str | None = attrs.field(default=None, repr=False)

    @property
    def key(self) -> str:
        """The ``host:port`` name used in URLs, headers, logs, status and the admin API."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# --- value parsers: each takes a str (command line, environment) or a native TOML value -----


def parse_backend_address(option: str, value: str) -> BackendSpec:
    """``host:port`` or ``http://host:port`` (a trailing ``/`` is allowed, a path is not)."""
    text = value.strip()
    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"--{option}: {value!r} is not host:port") from None
    if (
        parts.scheme != "http"
        or not parts.hostname
        or not port
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "#" in text
        or parts.username
    ):
        if parts.scheme == "http" and parts.path not in ("", "/") and parts.netloc:
            raise ConfigError(
                f"--{option}: {value!r} has a path; give the server alone, "
                f"'http://{parts.netloc}' (txlb forwards each request's own path, /v1/... "
                "included)")
        raise ConfigError(f"--{option}: {value!r} is not host:port or http://host:port")
    host = parts.hostname
    if not is_host_name(host):
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise ConfigError(
            f"--{option}: {shown!r}: the host is not an IP address or a DNS name (labels "
            "of 1-63 letters, digits and '-', 253 in all; IPv6 as [::1]:8002)")
    if ":" in host:
        # one spelling per address ([0:0::1] is [::1]), so the key -- what duplicates,
        # drain and remove go by -- names each backend once
        host = ipaddress.IPv6Address(host).compressed
    return BackendSpec(host=host, port=port)


def parse_backends(option: str, value: object, top_level: Collection[str] = ()
                   ) -> tuple[BackendSpec | DnsBackendSpec, ...]:
    """
    Comma-separated addresses (command line, environment), or the TOML ``[[backends]]``
    tables / a TOML list of address strings; ``dns:NAME:PORT`` and ``srv:NAME`` entries
    among them are names resolved at run time (:func:`split_backends` separates them).
    ``top_level``: the config file's own keys, named as such when one lands in a table
    (see :func:`backend_item`).
    """
    items: Sequence[object]
    if isinstance(value, str):
        items = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise ConfigError(f"--{option}: {value!r} is not a list of backends")
    specs = tuple(_member_item(option, item, top_level) for item in items)
    if not specs and not isinstance(value, list):
        # the config file's explicit ``backends = []`` is a fleet the admin API or DNS
        # fills; an empty --backends / LB_BACKENDS is a mistake
        raise ConfigError(f"--{option}: {value!r} names no backend")
    seen: set[str] = set()
    for spec in specs:
        if spec.key in seen:
            raise ConfigError(f"--{option}: backend {spec.key} is listed twice")
        seen.add(spec.key)
    return specs


_BACKEND_TABLE_KEYS = {"url", "weight", "max_conns", "models", "api_key", "api_key_env"}
#: An engine's key: printable ASCII without spaces (it goes into a header as it is).
_ENGINE_KEY = re.compile(r"[\x21-\x7e]{1,512}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

#: The most addresses one ``dns:``/``srv:`` name brings into the pool: a hostile or broken
#: DNS answer of thousands of records is cut here (the lowest addresses are kept, so the
#: same answer always gives the same members).
MAX_ADDRESSES_PER_NAME = 128


@attrs.frozen
class DnsBackendSpec:
    """
    A ``--backends`` entry resolved at run time: ``dns:NAME:PORT`` (every A/AAAA address
    of NAME is a backend on PORT) or ``srv:_service._proto.NAME`` (every SRV target, on its
    own port and with its record's weight).  ``weight``, ``max_conns`` and ``models`` apply
    to every address the name yields (an ``srv:`` entry's weight comes from its records).
    """

    kind: str  # "dns" or "srv"
    name: str
    port: int = 0  # dns: only; an srv: record carries each target's port
    weight: int = 1
    max_conns: int = 0
    models: tuple[str, ...] = ()
    api_key: str | None = attrs.field(default=None, repr=False)

    @property
    def key(self) -> str:
        """How the entry is written and shown: ``dns:NAME:PORT`` or ``srv:NAME``."""
        return f"dns:{self.name}:{self.port}" if self.kind == "dns" else f"srv:{self.name}"

    def backend(self, host: str, port: int, weight: int | None = None) -> BackendSpec:
        """The backend one resolved address is."""
        return BackendSpec(host=host, port=port,
                           weight=self.weight if weight is None else weight,
                           max_conns=self.max_conns, models=self.models,
                           api_key=self.api_key)


#: an SRV owner name: ``_service._proto.`` then a host name (RFC 2782)
_SRV_NAME = re.compile(r"_[a-z0-9-]{1,62}\._(tcp|udp)\.(.+)", re.IGNORECASE)


def parse_dns_entry(option: str, value: str) -> DnsBackendSpec:
    """``dns:NAME:PORT`` or ``srv:_service._proto.NAME``, checked as a name DNS can hold."""
    text = value.strip()
    shown = text if len(text) <= 80 else text[:77] + "..."
    kind, _, rest = text.partition(":")
    kind = kind.lower()
    if kind == "dns":
        name, sep, port_text = rest.rpartition(":")
        name = name.rstrip(".").lower()
        if not sep or not re.fullmatch(r"\d{1,5}", port_text) \
                or not 0 < int(port_text) <= 65535:
            raise ConfigError(f"--{option}: {shown!r} is not dns:NAME:PORT (a port from 1 "
                              "to 65535)")
        if not name or ":" in name or not is_host_name(name) or is_address(name):
            raise ConfigError(f"--{option}: {shown!r}: NAME is not a DNS name (labels of "
                              "1-63 letters, digits and '-', 253 in all)")
        return DnsBackendSpec("dns", name, int(port_text))
    name = rest.rstrip(".").lower()
    match = _SRV_NAME.fullmatch(name)
    if match is None or len(name) > 253 or not is_host_name(match.group(2)) \
            or is_address(match.group(2)):
        raise ConfigError(f"--{option}: {shown!r} is not srv:_service._proto.NAME (e.g. "
                          "srv:_http._tcp.vllm.example.com)")
    return DnsBackendSpec("srv", name)


def _is_dns_entry(text: str) -> bool:
    return text.strip().lower().startswith(("dns:", "srv:"))


def _member_item(option: str, item: object, top_level: Collection[str]
                 ) -> BackendSpec | DnsBackendSpec:
    """One ``--backends`` entry: an address, or a name resolved at run time."""
    if isinstance(item, str) and _is_dns_entry(item):
        return parse_dns_entry(option, item)
    if isinstance(item, dict) and isinstance(item.get("url"), str) \
            and _is_dns_entry(item["url"]):
        unknown = sorted(set(item) - _BACKEND_TABLE_KEYS, key=str)
        if unknown:
            return backend_item(option, item, top_level)  # the same refusal as any table's
        entry = parse_dns_entry("backends.url", item["url"])
        if entry.kind == "srv" and "weight" in item:
            raise ConfigError(f"backends.weight: {entry.key} takes each target's weight "
                              "from its SRV record; remove 'weight'")
        return attrs.evolve(entry, **_table_settings(item))
    return backend_item(option, item, top_level)


def split_backends(
    entries: Sequence[BackendSpec | DnsBackendSpec],
) -> tuple[tuple[BackendSpec, ...], tuple[DnsBackendSpec, ...]]:
    """The fixed addresses and the names resolved at run time, each in the order given."""
    return (tuple(e for e in entries if isinstance(e, BackendSpec)),
            tuple(e for e in entries if isinstance(e, DnsBackendSpec)))


def parse_resolver(option: str, value: object) -> tuple[tuple[str, int], ...]:
    """
    ``--resolver``: comma-separated DNS servers, ``HOST`` or ``HOST:PORT`` (IPv6 as
    ``[::1]:53``), asked in turn; empty means the system's ``/etc/resolv.conf``.
    """
    if isinstance(value, list | tuple):
        items = [str(item) for item in value]
    else:
        items = [part for part in str(value).split(",") if part.strip()]
    servers = []
    for item in items:
        text = item.strip()
        match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d{1,5}))?|([0-9.]+)(?::(\d{1,5}))?",
                             text)
        host = port = None
        if match is not None:
            host = match.group(1) or match.group(3)
            port = int(match.group(2) or match.group(4) or 53)
        if host is None or port is None or not 0 < port <= 65535 or not is_address(host):
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ConfigError(f"--{option}: {shown!r} is not a DNS server's IP address "
                              "(HOST or HOST:PORT; IPv6 as [::1]:53)")
        servers.append((ipaddress.ip_address(host).compressed, port))
    return tuple(servers)


def backend_item(option: str, item: object, top_level: Collection[str] = ()) -> BackendSpec:
    """
    One fixed backend: an address string or a ``[[backends]]`` table.  A table's unknown
    key that is one of ``top_level`` (the config file's own keys) is named as such: TOML
    puts every key written after a ``[[backends]]`` header into that table.
    """
    if isinstance(item, str):
        return parse_backend_address(option, item)
    if not isinstance(item, dict):
        raise ConfigError(f"--{option}: {item!r} is not a backend")
    url = item.get("url")
    where = f"the backend table for {url!r}" if isinstance(url, str) else "a backend table"
    unknown = sorted(set(item) - _BACKEND_TABLE_KEYS, key=str)
    if unknown:
        first = str(unknown[0])
        # TOML puts every key after a [[backends]] header into that table: a top-level
        # option written below the tables lands here
        hint = (f" ({first!r} is a top-level option: TOML reads every key after a "
                "[[backends]] header as part of that table, so write top-level keys before "
                "the first [[backends]])") if first in top_level else ""
        raise ConfigError(f"backends: unknown key {first!r} in {where}"
                          f"{did_you_mean(first, _BACKEND_TABLE_KEYS)}; a backend table "
                          f"takes {', '.join(sorted(_BACKEND_TABLE_KEYS))}{hint}")
    if "url" not in item:
        raise ConfigError("backends: a backend table has no 'url' (add url = "
                          "\"http://host:port\")")
    if not isinstance(item["url"], str):
        raise ConfigError(f"backends.url: {item['url']!r} is not a string")
    spec = parse_backend_address("backends.url", item["url"])
    return attrs.evolve(spec, **_table_settings(item))


def _table_settings(item: dict[str, Any]) -> dict[str, Any]:
    """A backend table's ``weight``, ``max_conns``, ``models`` and engine key, checked."""
    weight = parse_count("backends.weight", item.get("weight", 1))
    max_conns = parse_nonnegative_int("backends.max_conns", item.get("max_conns", 0))
    models = item.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"backends.models: {models!r} is not a list of model names")
    return {"weight": weight, "max_conns": max_conns, "models": tuple(models),
            "api_key": _engine_key(item)}


def _engine_key(item: dict[str, Any]) -> str | None:
    """
    The engine's key of a backend table: ``api_key`` written in the file, or
    ``api_key_env``, the environment variable that holds it (read when the config is
    built, so a reload reads it again).  A message never shows the key.
    """
    if "api_key" in item and "api_key_env" in item:
        raise ConfigError("backends: give api_key or api_key_env, not both")
    if "api_key_env" in item:
        name = item["api_key_env"]
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"backends.api_key_env: {name!r} is not an environment "
                              "variable's name")
        key = os.environ.get(name)
        if key is None:
            raise ConfigError(f"backends.api_key_env: the environment has no {name}")
    else:
        key = item.get("api_key")
        if key is None:
            return None
    if not isinstance(key, str) or not _ENGINE_KEY.fullmatch(key):
        raise ConfigError("backends.api_key: the engine's key is not 1-512 printable "
                          "ASCII characters without spaces")
    return key
