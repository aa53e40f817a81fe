"""
The ``[[classes]]`` table, ``--priority-header`` and ``--default-class``: parsed.

The priority classes' rules in one small module, read by the option table and, for
:data:`DEFAULT_CLASS`, by the routing request.  Every problem is one :class:`ConfigError`
line naming the key and the value, as for every option.

A class's ``queue_timeout`` falls back to ``--queue-timeout``, so the one check that needs
both -- ``starvation_age`` shorter than the class's queue timeout -- runs on the finished
:class:`~txlb._config.config.Config` (:func:`~txlb._config.config.check_classes`).
"""

from __future__ import annotations

import re

import attrs

from txlb._config.errors import ConfigError, did_you_mean

#: The classes a fleet gets when its config file has no ``[[classes]]``, highest first.
BUILT_IN_CLASSES = ("interactive", "default", "batch")
#: The class of a request that says nothing, unless ``--default-class`` names another.
DEFAULT_CLASS = "default"
#: A class name: what a header may carry and a log line shows without escaping.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
#: A header name (RFC 9110 token).
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: An API key's digest as ``[[classes]]`` ``keys`` lists it: sha256, in hex.
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")
_KEYS = ("name", "keys", "models", "paths", "queue_timeout", "starvation_age", "shed_at")
#: Classes at most: the queue keeps one deque per class and dispatch walks them in order.
MAX_CLASSES = 16


@attrs.frozen
class ClassSpec:
    """
    One ``[[classes]]`` entry.  ``keys`` are sha256 digests (hex) of the API keys bound to
    the class; ``models`` and ``paths`` (path prefixes) match requests to it like a route
    rule; ``queue_timeout`` ``None`` means ``--queue-timeout``; ``starvation_age`` ``None``
    means no guard; ``shed_at`` ``None`` means never shed.
    """

    name: str
    keys: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    queue_timeout: float | None = None
    starvation_age: float | None = None
    shed_at: int | None = None


def _seconds(key: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0 < value < float("inf")):
        raise ConfigError(f"classes.{key}: {value!r} of class {name!r} is not a positive number "
                          "of seconds")
    return float(value)


def _strings(key: str, name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        # keys are not echoed: a key pasted there by mistake must not reach a log
        shown = "its value" if key == "keys" else repr(value)
        raise ConfigError(f"classes.{key}: {shown} of class {name!r} is not a list of "
                          "non-empty strings")
    return tuple(value)


def _class_item(item: object, seen: set[str]) -> ClassSpec:
    if not isinstance(item, dict):
        raise ConfigError(f"classes: an entry ({type(item).__name__}) is not a table")
    name = item.get("name")
    unknown = sorted(set(item) - set(_KEYS), key=str)
    if unknown:
        where = f"class {name!r}" if isinstance(name, str) else "a [[classes]] table"
        raise ConfigError(f"classes: unknown key {unknown[0]!r} in {where}"
                          f"{did_you_mean(str(unknown[0]), _KEYS)}; a class takes "
                          f"{', '.join(_KEYS)}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"classes.name: {name!r} is not a class name (1-32 letters, digits, "
                          "'_', '-', '.', starting with a letter or digit)")
    if name.lower() in seen:
        raise ConfigError(f"classes.name: {name!r} is listed twice")
    seen.add(name.lower())
    keys: list[str] = []
    for key in _strings("keys", name, item.get("keys", [])):
        match = _DIGEST.fullmatch(key.strip().lower())
        if match is None:
            # the value is not shown: a key pasted here by mistake must not reach a log
            raise ConfigError(f"classes.keys: entry {len(keys) + 1} of class {name!r} is not the "
                              "sha256 of an API key in hex (printf %s \"$KEY\" | sha256sum); "
                              "the key itself is never written in the config")
        keys.append(match.group(1))
    paths = _strings("paths", name, item.get("paths", []))
    for path in paths:
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise ConfigError(f"classes.paths: {path!r} of class {name!r} is not a URL path "
                              "starting with '/'")
    shed_at = item.get("shed_at")
    if shed_at is not None and (isinstance(shed_at, bool) or not isinstance(shed_at, int)
                                or shed_at < 0):
        raise ConfigError(f"classes.shed_at: {shed_at!r} of class {name!r} is not a whole number "
                          "of waiting requests (0 or more)")
    timeout = item.get("queue_timeout")
    age = item.get("starvation_age")
    return ClassSpec(
        name=name, keys=tuple(keys), models=_strings("models", name, item.get("models", [])),
        paths=paths,
        queue_timeout=None if timeout is None else _seconds("queue_timeout", name, timeout),
        starvation_age=None if age is None else _seconds("starvation_age", name, age),
        shed_at=shed_at)


def parse_classes(option: str, value: object) -> tuple[ClassSpec, ...]:
    """The ``[[classes]]`` tables, highest precedence first; ``()`` for the built-in three."""
    if isinstance(value, tuple) and not value:
        return ()
    if not isinstance(value, list) or not value:
        raise ConfigError(f"classes: {value!r} is not a list of [[classes]] tables")
    if len(value) > MAX_CLASSES:
        raise ConfigError(f"classes: {len(value)} classes are more than {MAX_CLASSES}")
    seen: set[str] = set()
    specs = tuple(_class_item(item, seen) for item in value)
    owners: dict[str, str] = {}
    for spec in specs:
        for key in spec.keys:
            if key in owners:
                raise ConfigError(f"classes.keys: the key {key[:12]}... is bound to both "
                                  f"{owners[key]!r} and {spec.name!r}")
            owners[key] = spec.name
    return specs


def parse_priority_header(option: str, value: object) -> str | None:
    """A header name, or ``none`` (the header is ignored: keys and rules decide)."""
    text = str(value).strip()
    if text.lower() == "none":
        return None
    if not _HEADER.fullmatch(text):
        raise ConfigError(f"--{option}: {value!r} is not a header name or 'none'")
    return text


def parse_class_name(option: str, value: object) -> str:
    text = str(value).strip()
    if not _NAME.fullmatch(text):
        raise ConfigError(f"--{option}: {value!r} is not a class name")
    return text


def built_in(queue_timeout: float) -> tuple[ClassSpec, ...]:
    """
    ``interactive``, ``default``, ``batch``.  The two lower ones are guarded against
    starvation at half the queue timeout: under a steady stream of interactive requests a
    batch request is still served before it would time out.
    """
    return (ClassSpec("interactive"),
            ClassSpec("default", starvation_age=queue_timeout / 2),
            ClassSpec("batch", starvation_age=queue_timeout / 2))
