"""
Membership from DNS: ``--backends dns:NAME:PORT`` and ``srv:NAME`` resolved with Twisted's
own resolver, re-resolved on the records' TTL, their addresses joining and leaving the pool
through its methods (see docs/scale-out.md, "Membership from DNS").
"""
