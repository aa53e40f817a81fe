"""
Where txlb listens and who may see what: ``--listen``, ``--admin`` and its guards, and the
``on``/``loopback``/``off`` exposure of ``--lb-status`` and ``--x-backend``.

Endpoint strings are checked by Twisted's own parser, without a reactor: parsing the
config installs none.
"""

from __future__ import annotations

import ipaddress
import re

from txlb._config.errors import ConfigError
from txlb._config.hosts import is_host_name

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


EXPOSURES = ("on", "loopback", "off")


def parse_exposure(option: str, value: object) -> str:
    """``on``, ``loopback`` (only to clients on this host) or ``off``."""
    text = str(value).strip().lower()
    if isinstance(value, bool):
        text = "on" if value else "off"
    if text not in EXPOSURES:
        raise ConfigError(f"--{option}: {value!r} is not 'on', 'loopback' or 'off'")
    return text
