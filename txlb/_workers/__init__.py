"""
``--workers N``: the supervisor, the worker processes, and the messages between them.
"""
