"""
One frozen :class:`Config`, built from the command line, the environment, a TOML file and
the defaults, in that order of precedence.

Every option is described once, in :data:`OPTIONS`; the command-line parser (``tap.py``), the
environment lookup, the TOML reader and the documentation all read that table, so an option
cannot exist in one place and be forgotten in another.  Validation happens here, before any
port is opened, and every problem is a :class:`ConfigError` whose message names the option
and the offending value -- the one line an operator sees when start-up refuses.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import random
import re
import secrets
import stat
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
from twisted.internet.task import Clock

from txlb._config_classes import (
    DEFAULT_CLASS,
    ClassSpec,
    check_classes,
    parse_class_name,
    parse_classes,
    parse_priority_header,
)
from txlb._config_shared import SharedStateSpec, parse_shared_state
from txlb._scheduling.policies.registry import (
    BUILT_IN,
    DEFAULT_POLICY,
    find_factory,
    policy_names,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """
    A bad option value, unreadable config file or malformed backend.

    The message is complete on its own (it names the option and the value), so callers can
    print it as the single line that explains why start-up stopped -- one line even when a
    value or an underlying error message holds a newline.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


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

    @property
    def key(self) -> str:
        """The ``host:port`` name used in URLs, headers, logs, status and the admin API."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# --- value parsers: each takes a str (command line, environment) or a native TOML value -----


def _number(option: str, value: object) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"--{option}: {value!r} is not a number")
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an int past a float's range
            raise ConfigError(f"--{option}: {value!r} is too large") from None
    try:
        return float(str(value).strip())
    except ValueError:
        raise ConfigError(f"--{option}: {value!r} is not a number") from None


def parse_duration(option: str, value: object) -> float:
    """Seconds, decimals allowed; must be positive."""
    seconds = _number(option, value)
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"--{option}: {value!r} must be a positive number of seconds")
    return seconds


def parse_count(option: str, value: object) -> int:
    """A whole number, at least 1."""
    count = parse_nonnegative_int(option, value)
    if count < 1:
        raise ConfigError(f"--{option}: {value!r} must be at least 1")
    return count


def parse_nonnegative_int(option: str, value: object) -> int:
    """A whole number, 0 or more."""
    if isinstance(value, bool):
        raise ConfigError(f"--{option}: {value!r} is not a whole number")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"\d+", text):
            raise ConfigError(f"--{option}: {value!r} is not a whole number")
        number = int(text)
    if number < 0:
        raise ConfigError(f"--{option}: {value!r} must not be negative")
    return number


_SIZE_UNITS = {"": 1, "B": 1, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(option: str, value: object) -> int:
    """Bytes, or a number with a ``KiB``, ``MiB`` or ``GiB`` suffix."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]iB|B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--{option}: {value!r} is not a size (bytes, or N with KiB/MiB/GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])


def parse_path(option: str, value: object) -> str:
    """An absolute URL path such as ``/health``."""
    text = str(value)
    if not text.startswith("/") or any(c.isspace() for c in text):
        raise ConfigError(f"--{option}: {value!r} must be a URL path starting with '/'")
    return text


#: What endpoint strings are parsed with: a stand-in for the reactor they will listen on.
_PARSE_ONLY = object()


def parse_listen(option: str, value: object) -> str:
    """
    A port number or a Twisted server endpoint string.

    A bare number means ``tcp:N``; anything else is checked by Twisted's own endpoint parser
    so a typo is caught at start-up, not when the port is opened.
    """
    text = str(value).strip()
    if re.fullmatch(r"\d+", text):
        port = int(text)
        if port > 65535:
            raise ConfigError(f"--{option}: {value!r} is not a valid port")
        return f"tcp:{port}"
    if not text:
        raise ConfigError(f"--{option}: {value!r} is not an endpoint")
    from twisted.internet.endpoints import serverFromString

    try:
        # Only parsed, never listened on: the endpoint needs no reactor now.  Importing
        # the global one here would install the default reactor before twistd's
        # --reactor, or an embedder's own, had the chance.
        serverFromString(_PARSE_ONLY, text)
    except Exception:  # the parser raises ValueError, KeyError, TypeError...
        # Twisted's own words are Python's (invalid literal for int()...): say what is meant
        raise ConfigError(
            f"--{option}: {value!r} is not a port or a Twisted endpoint (a port number, "
            "'tcp:PORT:interface=ADDRESS', 'ssl:PORT:privateKey=KEY.pem:certKey=CERT.pem' "
            "or 'unix:PATH')"
        ) from None
    return text


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


#: An RFC 1123 label.  Not ``_``: Twisted's HTTP client (the prober) refuses such a name
#: ("invalid hostname"), so a backend called ``gpu_3`` could never be probed.
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)", re.IGNORECASE)


def is_host_name(host: str) -> bool:
    """
    Whether ``host`` (no brackets, no port) is an IPv4 or IPv6 address or an RFC 1123 host
    name.  urlsplit lets through anything between ``//`` and ``:``; this is what the prober,
    the upstream client and DNS can use, so a name nobody could connect to is refused where
    it is written instead of failing later, after the backend joined the pool.
    """
    if ":" in host:
        if "%" in host:  # a zone index (fe80::1%eth0) has no portable spelling in a URL
            return False
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return False
        return True
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.split("."))


def parse_backends(option: str, value: object) -> tuple[BackendSpec | DnsBackendSpec, ...]:
    """
    Comma-separated addresses (command line, environment), or the TOML ``[[backends]]``
    tables / a TOML list of address strings; ``dns:NAME:PORT`` and ``srv:NAME`` entries
    among them are names resolved at run time (:func:`split_backends` separates them).
    """
    items: Sequence[object]
    if isinstance(value, str):
        items = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise ConfigError(f"--{option}: {value!r} is not a list of backends")
    specs = tuple(_member_item(option, item) for item in items)
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


_BACKEND_TABLE_KEYS = {"url", "weight", "max_conns", "models"}

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

    @property
    def key(self) -> str:
        """How the entry is written and shown: ``dns:NAME:PORT`` or ``srv:NAME``."""
        return f"dns:{self.name}:{self.port}" if self.kind == "dns" else f"srv:{self.name}"

    def backend(self, host: str, port: int, weight: int | None = None) -> BackendSpec:
        """The backend one resolved address is."""
        return BackendSpec(host=host, port=port,
                           weight=self.weight if weight is None else weight,
                           max_conns=self.max_conns, models=self.models)


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
        if not name or ":" in name or not is_host_name(name) or _is_address(name):
            raise ConfigError(f"--{option}: {shown!r}: NAME is not a DNS name (labels of "
                              "1-63 letters, digits and '-', 253 in all)")
        return DnsBackendSpec("dns", name, int(port_text))
    name = rest.rstrip(".").lower()
    match = _SRV_NAME.fullmatch(name)
    if match is None or len(name) > 253 or not is_host_name(match.group(2)) \
            or _is_address(match.group(2)):
        raise ConfigError(f"--{option}: {shown!r} is not srv:_service._proto.NAME (e.g. "
                          "srv:_http._tcp.vllm.example.com)")
    return DnsBackendSpec("srv", name)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_dns_entry(text: str) -> bool:
    return text.strip().lower().startswith(("dns:", "srv:"))


def _member_item(option: str, item: object) -> BackendSpec | DnsBackendSpec:
    """One ``--backends`` entry: an address, or a name resolved at run time."""
    if isinstance(item, str) and _is_dns_entry(item):
        return parse_dns_entry(option, item)
    if isinstance(item, dict) and isinstance(item.get("url"), str) \
            and _is_dns_entry(item["url"]):
        unknown = sorted(set(item) - _BACKEND_TABLE_KEYS, key=str)
        if unknown:
            return _backend_item(option, item)  # the same refusal as any table's
        entry = parse_dns_entry("backends.url", item["url"])
        if entry.kind == "srv" and "weight" in item:
            raise ConfigError(f"backends.weight: {entry.key} takes each target's weight "
                              "from its SRV record; remove 'weight'")
        return attrs.evolve(entry, **_table_settings(item))
    return _backend_item(option, item)


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
        if host is None or port is None or not 0 < port <= 65535 or not _is_address(host):
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ConfigError(f"--{option}: {shown!r} is not a DNS server's IP address "
                              "(HOST or HOST:PORT; IPv6 as [::1]:53)")
        servers.append((ipaddress.ip_address(host).compressed, port))
    return tuple(servers)


def _backend_item(option: str, item: object) -> BackendSpec:
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
                "the first [[backends]])") if first in _BY_NAME else ""
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
    """A backend table's ``weight``, ``max_conns`` and ``models``, checked."""
    weight = parse_count("backends.weight", item.get("weight", 1))
    max_conns = parse_nonnegative_int("backends.max_conns", item.get("max_conns", 0))
    models = item.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"backends.models: {models!r} is not a list of model names")
    return {"weight": weight, "max_conns": max_conns, "models": tuple(models)}


def parse_log_file(option: str, value: object) -> str:
    """A file path, ``-`` (standard output) or ``none``."""
    text = str(value).strip()
    if not text or "\0" in text:
        raise ConfigError(f"--{option}: {value!r} is not a file path, '-' or 'none'")
    return text


def parse_log_format(option: str, value: object) -> str:
    text = str(value).strip().lower()
    if text not in ("text", "json"):
        raise ConfigError(f"--{option}: {value!r} is not 'text' or 'json'")
    return text


def parse_log_content(option: str, value: object) -> int:
    """Characters of the answer kept in the result log: 0 to 1000."""
    from txlb._records.summary import MAX_PREVIEW_CHARS

    number = parse_nonnegative_int(option, value)
    if number > MAX_PREVIEW_CHARS:
        raise ConfigError(f"--{option}: {value!r} is more than {MAX_PREVIEW_CHARS} characters")
    return number


def parse_log_user(option: str, value: object) -> str:
    text = str(value).strip().lower()
    if text not in ("keep", "hash", "drop"):
        raise ConfigError(f"--{option}: {value!r} is not 'keep', 'hash' or 'drop'")
    return text


def parse_log_error_body(option: str, value: object) -> int | None:
    """``keep`` (``None``: all of it, up to the 8 KiB cap), ``none`` (0) or N characters."""
    text = str(value).strip().lower()
    if text == "keep":
        return None
    if text == "none":
        return 0
    try:
        return parse_nonnegative_int(option, value)
    except ConfigError:
        raise ConfigError(f"--{option}: {value!r} is not 'keep', 'none' or a number of "
                          "characters") from None


def parse_secret(option: str, value: object) -> str | None:
    """A key for the ``user`` digest: at least 16 characters (the message never shows it)."""
    if value is None:
        return None
    text = str(value)
    if len(text.strip()) < 16:
        raise ConfigError(f"--{option}: the key must be at least 16 characters")
    return text


def parse_admin(option: str, value: object) -> str:
    """``none``, a port (on loopback: the admin API is not for the world) or an endpoint."""
    text = str(value).strip()
    if text.lower() == "none":
        return "none"
    if re.fullmatch(r"\d+", text):
        return parse_listen(option, text) + ":interface=127.0.0.1"
    return parse_listen(option, text)


def parse_token(option: str, value: object) -> str | None:
    if value is None:
        return None
    text = str(value)
    if not text.strip() or any(c.isspace() for c in text):
        raise ConfigError(f"--{option}: the token must be non-empty and contain no spaces")
    return text


def parse_admin_hosts(option: str, value: object) -> tuple[str, ...]:
    """
    Host names the admin port answers to besides loopback names and its own address: a
    comma-separated string or a TOML list; ``*`` means any.  Entries are host names or IP
    literals without a port (any port matches), kept lower-case, IPv6 in brackets -- the
    form they take in a ``Host`` header.
    """
    if isinstance(value, tuple) and not value:
        return ()
    if isinstance(value, str):
        items: list[object] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ConfigError(f"--{option}: {value!r} is not a comma-separated list of host names")
    hosts = []
    for item in items:
        text = str(item).strip().lower() if isinstance(item, str) else ""
        bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if text != "*" and not (bare and is_host_name(bare)
                                and (bare == text or ":" in bare)):
            raise ConfigError(f"--{option}: {item!r} is not a host name or IP address "
                              "(without a port)")
        hosts.append(f"[{ipaddress.IPv6Address(bare).compressed}]" if ":" in bare else text)
    return tuple(hosts)


_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|::1|localhost)$")


def is_loopback_endpoint(endpoint: str) -> bool:
    """
    Whether a server endpoint string listens only where the local machine can reach it:
    a TCP port bound to a loopback interface, or a UNIX socket.
    """
    parts = re.split(r"(?<!\\):", endpoint)
    if parts[0].lower() == "unix":
        return True
    for part in parts[1:]:
        if part.startswith("interface="):
            return bool(_LOOPBACK.match(part[len("interface="):].replace("\\:", ":")))
    return False


def parse_nonnegative_seconds(option: str, value: object) -> float:
    seconds = _number(option, value)
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"--{option}: {value!r} must be 0 or more seconds")
    return seconds


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


EXPOSURES = ("on", "loopback", "off")


def parse_exposure(option: str, value: object) -> str:
    """``on``, ``loopback`` (only to clients on this host) or ``off``."""
    text = str(value).strip().lower()
    if isinstance(value, bool):
        text = "on" if value else "off"
    if text not in EXPOSURES:
        raise ConfigError(f"--{option}: {value!r} is not 'on', 'loopback' or 'off'")
    return text


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


def parse_cache_block(option: str, value: object) -> int:
    """Characters per hashed block: a whole number from 16 to 65536."""
    number = parse_nonnegative_int(option, value)
    if not 16 <= number <= 65536:
        raise ConfigError(f"--{option}: {value!r} must be from 16 to 65536 characters")
    return number


def parse_cache_entries(option: str, value: object) -> int:
    """The index's cap in entries: a whole number, at least 1,000."""
    number = parse_nonnegative_int(option, value)
    if number < 1000:
        raise ConfigError(f"--{option}: {value!r} must be at least 1000")
    return number


def parse_cache_load(option: str, value: object) -> float:
    """The bounded-load factor: a number from 1 (strict balance) to 100."""
    factor = _number(option, value)
    if not 1.0 <= factor <= 100.0:
        raise ConfigError(f"--{option}: {value!r} must be a number from 1 to 100")
    return factor


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


@attrs.frozen
class OptionSpec:
    """One option: its long name, environment variable, default and parser."""

    name: str
    default: object
    parse: Callable[[str, Any], Any]
    #: the help line, or a function giving it when it depends on what is installed
    help: str | Callable[[], str]
    env: str | None = None
    cli: bool = True
    #: the default as ``--help`` shows it, where its value does not read well (a list, none)
    shown_default: str | None = None

    @property
    def attribute(self) -> str:
        return self.name.replace("-", "_")

    @property
    def help_text(self) -> str:
        return self.help if isinstance(self.help, str) else self.help()


DEFAULT_BACKENDS = ",".join(f"127.0.0.1:{port}" for port in range(8002, 8010))
#: the default fleet in words, for the refusal of a config file that names no backends
_DEFAULT_FLEET = "127.0.0.1:8002-8009"

OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("listen", "tcp:8000", parse_listen,
               "Port number or Twisted endpoint string to serve clients on.", "LB_PORT"),
    OptionSpec("backends", DEFAULT_BACKENDS, parse_backends,
               "Comma-separated host:port or http://host:port backends; dns:NAME:PORT "
               "(every A/AAAA address of NAME) and srv:_service._proto.NAME (SRV records) "
               "are re-resolved on their TTL. The default applies only without --config: "
               "a config file must have a backends key (backends = [] for none).",
               "LB_BACKENDS",
               shown_default="the eight backends 127.0.0.1:8002 to 127.0.0.1:8009"),
    OptionSpec("health-interval", 10.0, parse_duration,
               "Seconds between active probes of each backend.", "LB_HC_INTERVAL"),
    OptionSpec("health-path", "/health", parse_path, "Path probed on each backend."),
    OptionSpec("health-timeout", 5.0, parse_duration, "Seconds a probe may take."),
    OptionSpec("fall", 3, parse_count,
               "Consecutive ambiguous probe failures (timeout, reset) that mark a backend down."),
    OptionSpec("rise", 1, parse_count,
               "Consecutive successful probes that bring a down backend back."),
    OptionSpec("connect-timeout", 5.0, parse_duration,
               "Seconds to open an upstream connection."),
    OptionSpec("read-timeout", 300.0, parse_duration,
               "Seconds the upstream may stay silent (before headers or between chunks)."),
    OptionSpec("send-timeout", 60.0, parse_duration,
               "Seconds a client may go without reading while the response waits for it."),
    OptionSpec("log-file", "lb_results.log", parse_log_file,
               "The result log: a path, '-' for standard output, 'none' to disable.",
               "LB_LOG_FILE"),
    OptionSpec("log-max-bytes", "50MiB", parse_size,
               "Rotate the result log when it reaches this size (bytes, KiB, MiB, GiB)."),
    OptionSpec("log-backups", 3, parse_nonnegative_int,
               "Rotated result logs kept (<name>.1 is the newest)."),
    OptionSpec("log-format", "text", parse_log_format,
               "Result log format: 'text' (one line per request) or 'json' (JSON lines)."),
    OptionSpec("log-content", 200, parse_log_content,
               "Characters of each answer kept after '|' in the result log (0: none, "
               "at most 1000)."),
    OptionSpec("log-user", "keep", parse_log_user,
               "An orid taken from the body's 'user': 'keep', 'hash' (a keyed digest) or "
               "'drop'."),
    OptionSpec("log-user-key", None, parse_secret,
               "Key of the 'hash' digest, so it is stable across restarts (environment or "
               "config file only; default: a random key per start).", "LB_LOG_USER_KEY",
               cli=False),
    OptionSpec("log-error-body", "keep", parse_log_error_body,
               "Error bodies in the result log: 'keep' (up to 8 KiB), 'none', or N characters."),
    OptionSpec("admin", "tcp:8001:interface=127.0.0.1", parse_admin,
               "Admin endpoint (status, drain, metrics); a bare port binds 127.0.0.1; "
               "'none' disables it.", "LB_ADMIN"),
    OptionSpec("admin-token", None, parse_token,
               "Require 'Authorization: Bearer <token>' on the admin port.", "LB_ADMIN_TOKEN"),
    OptionSpec("admin-hosts", (), parse_admin_hosts,
               "More Host names the admin port answers to, comma-separated ('*': any), "
               "besides loopback names and its own address.", "LB_ADMIN_HOSTS"),
    OptionSpec("shutdown-timeout", 30.0, parse_duration,
               "Seconds in-flight requests get to finish on SIGTERM/SIGINT."),
    OptionSpec("policy", DEFAULT_POLICY, parse_policy, describe_policies, "LB_POLICY"),
    OptionSpec("queue-timeout", 30.0, parse_duration,
               "Seconds a request may wait when every backend for it is at max_conns."),
    OptionSpec("unknown-model", "404", parse_unknown_model,
               "A request naming a model no backend lists: '404' (an OpenAI-style error, as "
               "vLLM answers) or 'forward' (to any backend by the policy, as nginx would).",
               "LB_UNKNOWN_MODEL"),
    OptionSpec("cache-block", 256, parse_cache_block,
               "--policy cache-aware: characters per hashed prompt block (16 to 65536; "
               "256 is ~64 tokens).", "LB_CACHE_BLOCK"),
    OptionSpec("cache-entries", 200_000, parse_cache_entries,
               "--policy cache-aware: prompt blocks remembered over all backends "
               "(1,000 or more; ~116 bytes each).", "LB_CACHE_ENTRIES"),
    OptionSpec("cache-load", 1.25, parse_cache_load,
               "--policy cache-aware: a backend above this many times its fair share of "
               "the in-flight requests is passed over for its cache (as --affinity's 1.25).",
               "LB_CACHE_LOAD"),
    OptionSpec("affinity", None, parse_affinity,
               "Session affinity: 'header:NAME' or 'user' (bounded-load consistent hashing)."),
    OptionSpec("routes", (), parse_routes,
               "Model aliases split by weight (config file [[routes]] only).", cli=False),
    OptionSpec("retries", 2, parse_nonnegative_int,
               "Extra tries on another backend (refused/reset before a response, 502/503)."),
    OptionSpec("retry-window", 10.0, parse_duration,
               "Seconds after the request's arrival past which no new try starts."),
    OptionSpec("outlier-5xx", 5, parse_nonnegative_int,
               "5xx answers in a row that eject a backend for a cool-down (0: never)."),
    OptionSpec("outlier-cooldown", 30.0, parse_duration,
               "Seconds of the first outlier ejection; it grows with each repeat."),
    OptionSpec("hung-after", 1.25, parse_nonnegative_seconds,
               "Seconds without a byte from a backend while it has requests -- in flight, or "
               "left unanswered by clients who gave up -- and others answer, that get it "
               "probed at once and marked down if its health path does not answer within 1s "
               "(0: never)."),
    OptionSpec("slow-start", 0.0, parse_nonnegative_seconds,
               "Seconds over which a recovered backend's weight ramps from 1% to full."),
    OptionSpec("max-body", "64MiB", parse_size,
               "Larger request bodies get 413 (checked while the body arrives)."),
    OptionSpec("header-timeout", 30.0, parse_duration,
               "Seconds a client may take to send a request's line and headers."),
    OptionSpec("rate-limit", None, parse_rate,
               "Requests per client key, e.g. '100/s' or '600/m' (token bucket)."),
    OptionSpec("rate-burst", None, parse_count,
               "Bucket size: requests a key may send at once.",
               shown_default="one second's worth of --rate-limit"),
    OptionSpec("rate-key", "ip", parse_rate_key,
               "What a client is: 'ip', 'token' (the bearer token, never logged) or "
               "'header:NAME'."),
    OptionSpec("workers", 1, parse_count,
               "Processes sharing the listening socket (tcp only), with least-connections "
               "exact across them."),
    OptionSpec("lb-status", "on", parse_exposure,
               "GET /__lb_status on the main port: 'on', 'loopback' (answered to clients on "
               "this host only; others reach a backend) or 'off' (always sent to a backend)."),
    OptionSpec("x-backend", "on", parse_exposure,
               "X-Backend and X-Backend-Port on responses: 'on', 'loopback' (to clients on "
               "this host only) or 'off'."),
    OptionSpec("budgets", (), parse_budgets,
               "Token budgets per client key or priority class (config file [[budgets]] "
               "only).", cli=False),
    OptionSpec("budget-completion-estimate", 256, parse_completion_estimate,
               "Completion tokens a token budget reserves for a request that sets no "
               "max_tokens (reconciled from usage at the end)."),
    OptionSpec("classes", (), parse_classes,
               "Priority classes, highest first (config file [[classes]] only; default: "
               "interactive, default, batch).", cli=False),
    OptionSpec("priority-header", "X-Priority", parse_priority_header,
               "Request header naming a priority class ('none': ignore it).",
               "LB_PRIORITY_HEADER"),
    OptionSpec("default-class", DEFAULT_CLASS, parse_class_name,
               "Priority class of a request that names none and matches no class.",
               "LB_DEFAULT_CLASS"),
    OptionSpec("resolver", (), parse_resolver,
               "DNS servers for dns:/srv: backends, HOST[:PORT] comma-separated.",
               "LB_RESOLVER", shown_default="the system's, from /etc/resolv.conf"),
    OptionSpec("shared-state", None, parse_shared_state,
               "Redis URL the replicas of a fleet share in-flight counts, drains, "
               "membership and rate buckets through: "
               "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (rediss:// for TLS; ?ca=PATH for "
               "a private CA, ?password_file=PATH, ?prefix=NAME; the password is never "
               "shown).", "LB_SHARED_STATE", shown_default="none (one replica alone)"),
)

_BY_NAME = {spec.name: spec for spec in OPTIONS}

#: Keys the contract defines whose features are still to come: a config file written for
#: them is accepted (with a warning) rather than refused, so it keeps working on upgrade.
PLANNED_KEYS: frozenset[str] = frozenset()


@attrs.frozen
class Config:
    """Everything the balancer needs to start, validated.  Build with :func:`build_config`."""

    backends: tuple[BackendSpec, ...]
    listen: str = "tcp:8000"
    health_interval: float = 10.0
    health_path: str = "/health"
    health_timeout: float = 5.0
    fall: int = 3
    rise: int = 1
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    send_timeout: float = 60.0
    log_file: str = "lb_results.log"
    log_max_bytes: int = 50 * 1024**2
    log_backups: int = 3
    log_format: str = "text"
    log_content: int = 200
    log_user: str = "keep"
    log_user_key: str | None = attrs.field(default=None, repr=False)
    log_error_body: int | None = None
    admin: str = "tcp:8001:interface=127.0.0.1"
    admin_token: str | None = None
    admin_hosts: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0
    policy: str = DEFAULT_POLICY
    queue_timeout: float = 30.0
    unknown_model: str = "404"
    affinity: str | None = None
    cache_block: int = 256
    cache_entries: int = 200_000
    cache_load: float = 1.25
    routes: tuple[RouteSpec, ...] = ()
    retries: int = 2
    retry_window: float = 10.0
    outlier_5xx: int = 5
    outlier_cooldown: float = 30.0
    hung_after: float = 1.25
    slow_start: float = 0.0
    max_body: int = 64 * 1024**2
    header_timeout: float = 30.0
    rate_limit: float | None = None
    rate_burst: int | None = None
    rate_key: str = "ip"
    workers: int = 1
    lb_status: str = "on"
    x_backend: str = "on"
    budgets: tuple[BudgetSpec, ...] = ()
    budget_completion_estimate: int = 256
    classes: tuple[ClassSpec, ...] = ()
    priority_header: str | None = "X-Priority"
    default_class: str = DEFAULT_CLASS
    resolver: tuple[tuple[str, int], ...] = ()
    #: the ``dns:``/``srv:`` entries of ``--backends`` (``backends`` holds the addresses)
    dns_backends: tuple[DnsBackendSpec, ...] = ()
    shared_state: SharedStateSpec | None = None


def check_workers(config: Config) -> None:
    """
    ``--workers`` above 1 shares one listening socket between processes, which txlb does
    for TCP endpoints only (an ``ssl:`` or ``unix:`` one is refused rather than half
    supported).
    """
    if config.workers > 1 and config.listen.split(":", 1)[0].lower() not in ("tcp", "tcp6"):
        raise ConfigError(f"--workers: {config.workers} worker processes need a tcp: "
                          f"--listen endpoint, not {config.listen!r}")


def closest_name(word: str, known: Iterable[str]) -> str | None:
    """
    The known name a mistyped ``word`` most likely meant, or ``None`` when none is close.
    Case, dashes and underscores do not count against a match: ``maxconns``,
    ``max-conns`` and ``MAX_CONNS`` all find ``max_conns``.
    """
    def plain(name: str) -> str:
        return name.lower().replace("-", "").replace("_", "")

    names = {plain(name): name for name in known}
    close = difflib.get_close_matches(plain(word), list(names), n=1, cutoff=0.75)
    return names[close[0]] if close else None


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" (did you mean 'max_conns'?)"``, or nothing when no known name is close."""
    name = closest_name(word, known)
    return f" (did you mean {name!r}?)" if name else ""


#: The largest ``--config`` file txlb reads: a real one is a few kilobytes (10,000 backend
#: tables are about 1 MiB), so anything past this is a mistake and refused rather than read
#: and parsed at length.
MAX_CONFIG_BYTES = 4 * 1024**2


def read_toml(path: str) -> dict[str, Any]:
    """
    Read the ``--config`` file, turning every way it can fail into a ConfigError.

    Only a regular file is read: the path is opened without blocking (a FIFO's open
    would wait for a writer) and the opened file itself is checked, so a FIFO, a device
    or a directory is refused, never waited on, however the path changes meanwhile.  At
    most :data:`MAX_CONFIG_BYTES` are read.  What the file holds may make the parser
    fail in three ways besides invalid TOML -- bytes that are not UTF-8, arrays or inline
    tables nested past Python's recursion limit, an integer too long to convert -- and
    each is the same one-line refusal.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path!r}: {error.strerror}") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"--config: {path!r} is not a regular file "
                              f"({_file_kind(mode)})")
        raw = _read_at_most(descriptor, MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path!r}: {error.strerror}") from None
    finally:
        os.close(descriptor)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config: {path!r} is larger than "
                          f"{MAX_CONFIG_BYTES // 1024**2} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"--config: {path!r} is not UTF-8 text: byte "
                          f"0x{raw[error.start]:02x} on line {line}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config: {path!r} is not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"--config: {path!r} is not valid TOML: arrays or inline tables "
                          "nested too deeply") from None
    except ValueError as error:  # an integer past Python's digit limit
        raise ConfigError(f"--config: {path!r} is not valid TOML: {error}") from None


def _read_at_most(descriptor: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of an open file, fewer only at its end."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(descriptor, min(left, 1024**2))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in a word."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((word for test, word in kinds if test(mode)), "not a file")


def build_config(
    command_line: Mapping[str, object | None],
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> Config:
    """
    Merge the sources in precedence order: command line > environment > TOML > default.

    ``command_line`` maps long option names (``"health-interval"``) to the value given on
    the command line, or ``None`` when it was not given; it may also hold ``"config"``.
    ``file_values`` is that file as :func:`read_toml` already read it (a reload reads it
    off the reactor thread); without it the file is read here.

    The default fleet (``127.0.0.1:8002``-``8009``) is for a start with nothing
    configured: a config file that has no ``backends`` key, with no ``--backends`` or
    ``LB_BACKENDS`` either, is refused -- it is what a truncated save leaves, and
    reloading it would send every request to whatever listens on those local ports.
    """
    env = os.environ if environ is None else environ
    config_path = command_line.get("config") or env.get("LB_CONFIG")
    in_file: dict[str, Any] = {}
    if config_path:
        in_file = dict(read_toml(str(config_path)) if file_values is None else file_values)
        for key in sorted(set(in_file) & PLANNED_KEYS):
            warnings.warn(f"{config_path}: {key!r} is not supported by this version of "
                          "txlb yet and is ignored", stacklevel=2)
            del in_file[key]
        unknown = sorted(set(in_file) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"--config: unknown key {unknown[0]!r} in {config_path}"
                              f"{did_you_mean(unknown[0], _BY_NAME)}")

    values: dict[str, Any] = {}
    for spec in OPTIONS:
        given = command_line.get(spec.name)
        label = spec.name
        if given is None and spec.env and spec.env in env:
            given, label = env[spec.env], f"{spec.name} (from {spec.env})"
        if given is None and spec.name in in_file:
            given, label = in_file[spec.name], f"{spec.name} (from {config_path})"
        if given is None:
            given = spec.default
        values[spec.attribute] = None if given is None else spec.parse(label, given)
    if (config_path and "backends" not in in_file and command_line.get("backends") is None
            and "LB_BACKENDS" not in env):
        raise ConfigError(f"--config: {config_path} has no 'backends' key: list the "
                          "backends there (backends = [] for a fleet the admin API "
                          "fills) or give --backends; the default fleet "
                          f"({_DEFAULT_FLEET}) is used only without a config file")
    values["backends"], values["dns_backends"] = split_backends(values["backends"])
    config = Config(**values)
    check_workers(config)
    check_classes(config)
    if config.log_user == "hash" and config.log_user_key is None:
        # chosen once, here, so that every --workers worker digests with the same key
        config = attrs.evolve(config, log_user_key=secrets.token_hex(32))
    return config
