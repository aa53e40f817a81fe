"""Registers ``twistd --reactor txlb-epoll``; the reactor lives in txlb._server.reactor."""

from twisted.application.reactors import Reactor

txlb_epoll = Reactor(
    "txlb-epoll",
    "txlb._server.reactor",
    "epoll without the per-event logging context (faster relaying; log lines lose the "
    "connection prefix)",
)
