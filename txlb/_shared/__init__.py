"""
``--shared-state``: the replicas of a fleet sharing in-flight counts, marks and rate buckets
through one Redis (see docs/scale-out.md).  :mod:`.link` is the connection and its
fallback, :mod:`.counts`, :mod:`.marks` and :mod:`.rate` the three shared parts, and
:mod:`.store` the :class:`~txlb._cluster.store.IBackendStore` that gathers them.
"""
