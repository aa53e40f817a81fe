"""
The client-facing server side: the HTTP channel and site with a proxy's limits, accept-error
summaries, and the ``txlb-epoll`` reactor.
"""
