"""
``--shared-state``: the Redis URL several replicas share their state through, parsed.

The URL's rules in one small module.  The password is the one secret here: it never
reaches a log line, ``/status`` or an error message -- :attr:`SharedStateSpec.masked` is
the only form of the URL anything shows, and every :class:`ConfigError` below is worded
without the value's password.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, unquote, urlsplit

import attrs

from txlb._config.errors import ConfigError

#: Longest password file read (a password is a line; a mistaken path to a big file is
#: refused rather than read whole).
MAX_PASSWORD_FILE = 4096
#: Largest CA file read (a bundle of a few certificates; a mistaken path to a big file is
#: refused rather than read whole).
MAX_CA_FILE = 1 << 20
#: Redis's default number of databases (``databases 16``); a higher one is refused here.
MAX_DB = 15
#: A password holding ``/``, ``?``, ``#`` or ``@`` breaks a URL unless percent-encoded.
_ENCODE_HINT = (" (percent-encode a password's / ? # @ as %2F %3F %23 %40, or put it in a "
                "password_file)")
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


@attrs.frozen
class SharedStateSpec:
    """Where the shared state lives: a Redis server, its database and its credentials."""

    host: str
    port: int
    db: int = 0
    tls: bool = False
    username: str | None = None
    #: never shown: :attr:`masked` is what logs, ``/status`` and errors print
    password: str | None = attrs.field(default=None, repr=False)
    #: the key prefix, so several fleets can share one Redis database
    prefix: str = "txlb"
    #: ``rediss://`` only: the CA certificates (PEM) the server's certificate must chain
    #: to, from ``?ca=PATH``; ``None``: the system's trusted CAs
    ca: str | None = attrs.field(default=None, repr=False)

    @property
    def masked(self) -> str:
        """The URL as txlb shows it: the password, if any, as ``***``."""
        scheme = "rediss" if self.tls else "redis"
        user = self.username or ""
        credentials = f"{user}:***@" if self.password is not None else (
            f"{user}@" if user else "")
        return f"{scheme}://{credentials}{self.host}:{self.port}/{self.db}"

    def __str__(self) -> str:
        return self.masked


def _refuse(option: str, masked: str, why: str) -> ConfigError:
    return ConfigError(f"--{option}: {masked!r} {why}")


def _masked_text(text: str) -> str:
    """
    ``text`` with whatever sits between ``://`` and its *last* ``@`` hidden (a URL not
    parsed yet).  A password may hold any character -- ``/``, ``@``, ``?`` included, when
    not percent-encoded -- so no character but the last ``@`` can be trusted to end it:
    hiding too much of a refused URL costs nothing, showing part of a password does.
    """
    start = text.find("://")
    end = text.rfind("@")
    if start < 0 or end < start + 3:
        return text
    return f"{text[:start + 3]}***{text[end:]}"


def parse_shared_state(option: str, value: object) -> SharedStateSpec | None:
    """
    ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?password_file=PATH&prefix=NAME]`` (or
    ``rediss://`` for TLS, with ``&ca=PATH`` for a private CA), or ``none``.  A password
    in a file (``password_file``, its first line) keeps it out of the process list and the
    unit file.
    """
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in ("", "none"):
        return None
    masked = _masked_text(text)
    if len(text) > 2048:
        raise _refuse(option, masked[:60] + "...", "is longer than 2048 characters")
    try:
        parts = urlsplit(text)
        port = parts.port or 6379
    except ValueError:
        raise _refuse(option, masked, "is not a redis:// URL with a valid port" + _ENCODE_HINT) \
            from None
    if parts.scheme not in ("redis", "rediss"):
        raise _refuse(option, masked, "must start with redis:// or rediss://")
    host = parts.hostname or ""
    if not _HOST.fullmatch(host if ":" not in host else f"[{host}]"):
        raise _refuse(option, masked, "names no valid host" + _ENCODE_HINT)
    path = parts.path.strip("/") or "0"
    if not path.isdigit() or int(path) > MAX_DB:
        raise _refuse(option, masked, f"must end with a database number 0..{MAX_DB}")
    password = unquote(parts.password) if parts.password is not None else None
    username = unquote(parts.username) if parts.username else None
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"password_file", "prefix", "ca"})
    if unknown:
        raise _refuse(option, masked, f"has an unknown parameter {unknown[0][:40]!r} "
                      "(known: password_file, prefix, ca)")
    prefix = query.get("prefix", ["txlb"])[-1]
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", prefix):
        raise _refuse(option, masked, "has a prefix that is not 1-64 of A-Z a-z 0-9 _ . -")
    files = query.get("password_file")
    if files:
        if password is not None:
            raise _refuse(option, masked, "has both a password and a password_file")
        password = _read_password(option, masked, files[-1])
    tls = parts.scheme == "rediss"
    ca = None
    if "ca" in query:
        if not tls:
            raise _refuse(option, masked, "names a ca, which only a rediss:// (TLS) URL uses")
        ca = _read_ca(option, masked, query["ca"][-1])
    return SharedStateSpec(host=host, port=port, db=int(path), tls=tls,
                           username=username, password=password, prefix=prefix, ca=ca)


_PEM_CERTIFICATE = re.compile(
    r"-----BEGIN CERTIFICATE-----\s[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----")


def ca_certificates(pem: str) -> list[str]:
    """The PEM certificates in a CA file's text, in order."""
    return _PEM_CERTIFICATE.findall(pem)


def _read_ca(option: str, masked: str, path: str) -> str:
    """The CA file's certificates, each checked to be one OpenSSL can load."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CA_FILE + 1)
    except OSError as error:
        raise _refuse(option, masked, f"ca cannot be read: {error.strerror}") from None
    if len(data) > MAX_CA_FILE:
        raise _refuse(option, masked, f"ca is over {MAX_CA_FILE} bytes")
    text = data.decode("ascii", "replace")
    certificates = ca_certificates(text)
    if not certificates:
        raise _refuse(option, masked, "ca holds no PEM certificate")
    from twisted.internet.ssl import Certificate

    for certificate in certificates:
        try:
            Certificate.loadPEM(certificate.encode("ascii"))
        except Exception:
            raise _refuse(option, masked, "ca holds a certificate that cannot be "
                          "read") from None
    return "\n".join(certificates) + "\n"


def _read_password(option: str, masked: str, path: str) -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PASSWORD_FILE + 1)
    except OSError as error:
        raise _refuse(option, masked, f"password_file cannot be read: {error.strerror}") \
            from None
    if len(data) > MAX_PASSWORD_FILE:
        raise _refuse(option, masked, f"password_file is over {MAX_PASSWORD_FILE} bytes")
    try:
        line = data.decode("utf-8").splitlines()[0].strip() if data.strip() else ""
    except UnicodeDecodeError:
        raise _refuse(option, masked, "password_file is not UTF-8 text") from None
    if not line:
        raise _refuse(option, masked, "password_file is empty")
    return line
