"""
``--workers N``: the supervisor, the worker processes, the typed messages between them
(wire), and the reports by which a worker's traffic reaches the supervisor's bookkeeper.
"""
