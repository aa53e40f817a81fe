"""
A stream resumed on another engine when its own fails part-way: what the client has of its
answer (:mod:`~txlb._resume.progress`), the continuation asked of the next engine
(:mod:`~txlb._resume.continuation`) and its events made the first try's
(:mod:`~txlb._resume.rewrite`).  Pure: the exchange drives them, and only a resumed stream
runs any of it.
"""
