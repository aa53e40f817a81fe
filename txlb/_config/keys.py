"""
The keys file of ``--auth keys`` (``--keys-file``): tenants and the digests of their API keys.

The file is TOML, read with the same bounded reader as ``--config``::

    [tenants.search]              # optional: a tenant with no table gets the defaults
    weight = 2.0                  # its share of the GPUs when requests queue (VTC)
    class = "interactive"         # the highest priority class its requests get
    models = ["llama-3-8b"]       # the only models it may use (default: every model)
    rate_limit = "20/s"           # requests per second (default: --rate-limit, if set)
    rate_burst = 40
    tokens_per_minute = 200000    # a token budget of its own
    tokens_per_day = 20000000

    [[keys]]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "search"
    label = "ci-runner"           # optional, shown by the admin API in place of the key

A key is never written in the file, only its SHA-256 (``python -m txlb.keys`` makes a key
and prints its entry).  Requests are matched by the digest of the key they present, so the
lookup is a dictionary probe on a digest: the time it takes tells nothing of how much of a
real key a guess shares.  Every problem is one :class:`ConfigError` line that names the
entry, never its digest in full and never a value that might be a key pasted by mistake.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

import attrs

from txlb._config.errors import ConfigError, did_you_mean
from txlb._config.limits import BUDGET_WINDOWS, MAX_BUDGET_TOKENS, parse_rate
from txlb._config.toml_file import read_toml

#: A tenant's name: what the result log, the metrics and the admin API show unescaped.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")
_LABEL = re.compile(r"[\x20-\x7e]{0,64}")
_TENANT_KEYS = ("weight", "class", "models", "rate_limit", "rate_burst", *BUDGET_WINDOWS)
_KEY_KEYS = ("sha256", "tenant", "label")
#: Keys a file may hold at most (a lookup table in every process; far above any team count).
MAX_KEYS = 100_000
#: Tenants at most: each is a label value of the metrics and a counter of the fair queue.
MAX_TENANTS = 10_000
#: The largest and smallest weight: a share of ``weight / sum of weights``.
MAX_WEIGHT = 1000.0
MIN_WEIGHT = 0.001


@attrs.frozen
class TenantSpec:
    """One tenant: its fair-share weight and what its keys may do."""

    name: str
    weight: float = 1.0
    #: the highest priority class its requests get (``None``: as without a key)
    priority: str | None = None
    #: the models it may name (``()``: any)
    models: tuple[str, ...] = ()
    #: requests per second, and the bucket's size (``None``: ``--rate-limit``'s)
    rate_limit: float | None = None
    rate_burst: int | None = None
    #: its own token budget: (seconds of the window, tokens), as ``[[budgets]]`` give them
    windows: tuple[tuple[float, int], ...] = ()


@attrs.frozen
class KeyEntry:
    """One key, known by its digest only."""

    digest: str = attrs.field(repr=lambda d: d[:8] + "...")
    tenant: str
    label: str = ""


@attrs.frozen
class KeysFile:
    """The keys file as read: its tenants by name and its keys by digest."""

    path: str
    tenants: tuple[TenantSpec, ...]
    keys: tuple[KeyEntry, ...] = attrs.field(repr=lambda keys: f"<{len(keys)} keys>")
    #: others than its owner may read it (a warning at start and on every reload)
    world_readable: bool = False
    #: the digest -> tenant table of every request's lookup, built once
    by_digest: dict[str, str] = attrs.field(init=False, eq=False, repr=False)
    by_name: dict[str, TenantSpec] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_digest", {k.digest: k.tenant for k in self.keys})
        object.__setattr__(self, "by_name", {t.name: t for t in self.tenants})

    def tenant(self, digest: str) -> TenantSpec | None:
        """The tenant whose key has this SHA-256 (hex), or ``None``."""
        name = self.by_digest.get(digest)
        return None if name is None else self.by_name[name]


def _where(kind: str, index: int) -> str:
    return f"--keys-file: {kind} entry {index}"


def _tenant(name: object, table: object) -> TenantSpec:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ConfigError(f"--keys-file: tenant name {name!r} is not a name (1-64 letters, "
                          "digits, '_', '.', '-', starting with a letter or digit)")
    if not isinstance(table, dict):
        raise ConfigError(f"--keys-file: tenants.{name} is not a table")
    unknown = sorted(set(table) - set(_TENANT_KEYS), key=str)
    if unknown:
        raise ConfigError(f"--keys-file: unknown key {unknown[0]!r} in tenants.{name}"
                          f"{did_you_mean(str(unknown[0]), _TENANT_KEYS)}; a tenant takes "
                          f"{', '.join(_TENANT_KEYS)}")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise ConfigError(f"--keys-file: tenants.{name}.weight {weight!r} is not a number "
                          f"from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}")
    priority = table.get("class")
    if priority is not None and (not isinstance(priority, str)
                                 or not TENANT_NAME.fullmatch(priority)):
        raise ConfigError(f"--keys-file: tenants.{name}.class {priority!r} is not a class name")
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m and len(m) <= 256
                                               for m in models):
        raise ConfigError(f"--keys-file: tenants.{name}.models is not a list of model names")
    rate = table.get("rate_limit")
    rate_limit = None if rate is None else parse_rate(f"keys-file: tenants.{name}.rate_limit",
                                                      rate)
    burst = table.get("rate_burst")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int)
                              or not 1 <= burst <= 10**9):
        raise ConfigError(f"--keys-file: tenants.{name}.rate_burst {burst!r} is not a whole "
                          "number of requests (1 or more)")
    windows = []
    for field, seconds in BUDGET_WINDOWS.items():
        if field not in table:
            continue
        tokens = table[field]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not (
                1 <= tokens <= MAX_BUDGET_TOKENS):
            raise ConfigError(f"--keys-file: tenants.{name}.{field} {tokens!r} is not a whole "
                              f"number of tokens from 1 to {MAX_BUDGET_TOKENS}")
        windows.append((seconds, tokens))
    return TenantSpec(name, float(weight), priority, tuple(models), rate_limit, burst,
                      tuple(windows))


def _key(index: int, item: object) -> KeyEntry:
    if not isinstance(item, dict):
        raise ConfigError(f"{_where('[[keys]]', index)} is not a table")
    unknown = sorted(set(item) - set(_KEY_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{_where('[[keys]]', index)}: unknown key {unknown[0]!r}"
                          f"{did_you_mean(str(unknown[0]), _KEY_KEYS)}; a key entry takes "
                          f"{', '.join(_KEY_KEYS)}")
    digest = item.get("sha256")
    match = _DIGEST.fullmatch(digest.strip().lower()) if isinstance(digest, str) else None
    if match is None:
        # not echoed: a key pasted here by mistake must not reach a log
        raise ConfigError(f"{_where('[[keys]]', index)}: sha256 is not the SHA-256 of a key "
                          "in hex (python -m txlb.keys makes a key and its entry); the key "
                          "itself is never written in the file")
    tenant = item.get("tenant")
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise ConfigError(f"{_where('[[keys]]', index)}: tenant {tenant!r} is not a tenant "
                          "name")
    label = item.get("label", "")
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ConfigError(f"{_where('[[keys]]', index)}: label is not at most 64 printable "
                          "ASCII characters")
    return KeyEntry(match.group(1), tenant, label)


def parse_keys(path: str, values: dict[str, Any], world_readable: bool = False) -> KeysFile:
    """The keys file's ``values`` (as :func:`read_toml` read them), checked."""
    unknown = sorted(set(values) - {"tenants", "keys"}, key=str)
    if unknown:
        raise ConfigError(f"--keys-file: unknown key {unknown[0]!r} in {path}; the file holds "
                          "[tenants.NAME] tables and [[keys]] entries")
    tables = values.get("tenants", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"--keys-file: 'tenants' in {path} is not a table of tenants")
    items = values.get("keys", [])
    if not isinstance(items, list):
        raise ConfigError(f"--keys-file: 'keys' in {path} is not a list of [[keys]] entries")
    if len(items) > MAX_KEYS:
        raise ConfigError(f"--keys-file: {len(items)} keys are more than {MAX_KEYS}")
    specs = {name: _tenant(name, table) for name, table in tables.items()}
    keys: list[KeyEntry] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items, 1):
        entry = _key(index, item)
        if entry.digest in seen:
            raise ConfigError(f"{_where('[[keys]]', index)}: the same key as entry "
                              f"{seen[entry.digest]} ({entry.digest[:8]}...)")
        seen[entry.digest] = index
        keys.append(entry)
        specs.setdefault(entry.tenant, TenantSpec(entry.tenant))
    if len(specs) > MAX_TENANTS:
        raise ConfigError(f"--keys-file: {len(specs)} tenants are more than {MAX_TENANTS}")
    return KeysFile(path, tuple(specs[name] for name in sorted(specs)), tuple(keys),
                    world_readable)


def read_keys(path: str) -> KeysFile:
    """Read and check the keys file at ``path`` (a bounded read, as ``--config``'s)."""
    values = read_toml(path, option="keys-file")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    return parse_keys(path, values, bool(mode & (stat.S_IROTH | stat.S_IWOTH)))


def parse_auth(option: str, value: object) -> str:
    """``off`` (no keys asked) or ``keys`` (every request needs a key of ``--keys-file``)."""
    text = str(value).strip().lower()
    if text not in ("off", "keys"):
        raise ConfigError(f"--{option}: {value!r} is not 'off' or 'keys'")
    return text


def parse_fairness(option: str, value: object) -> str | None:
    """``fifo``, ``vtc``, or ``auto`` (``None``: VTC with ``--auth keys``, else FIFO)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text not in ("fifo", "vtc"):
        raise ConfigError(f"--{option}: {value!r} is not 'fifo', 'vtc' or 'auto'")
    return text


def parse_keys_path(option: str, value: object) -> str | None:
    text = str(value).strip()
    if text.lower() in ("", "none"):
        return None
    return text
