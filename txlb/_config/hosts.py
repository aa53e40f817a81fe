"""
What a host may be: an IP address or an RFC 1123 name.

Read by every option that names a host (``--backends``, ``--admin-hosts``, ``dns:`` names)
and by what checks hosts arriving later (DNS answers, the shared marks), so the rule is
written once.
"""

from __future__ import annotations

import ipaddress
import re

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


def is_address(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
