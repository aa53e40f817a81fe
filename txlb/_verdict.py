"""
The one line a successful configuration check prints (``OK: lb.toml (3 backends, ...)``).

It lives below both doors that print it -- ``python -m txlb.check`` and ``twistd -n llmlb
--check`` (``txlb.tap``'s options) -- so that neither has to import the other for it.
"""

from __future__ import annotations

from txlb._config.config import Config


def verdict(config: Config, path: str | None) -> str:
    """The line a successful check prints."""
    where = path if path is not None else "(no --config file: command line and environment)"
    count = len(config.backends)
    names = len(config.dns_backends)
    resolved = f" and {names} DNS name{'s' if names != 1 else ''}" if names else ""
    return (f"OK: {where} ({count} backend{'s' if count != 1 else ''}{resolved}, policy "
            f"{config.policy})")
