"""
The main port's server, twisted.web's (``lb.site()``) against the lean one
(``lb.main_factory()``, what ``twistd llmlb`` listens with): CPU µs per small request, in
memory, in alternating rounds (``python -m bench.lean_server [NUMBER [ROUNDS]]``).

Two paths, each on one kept-alive connection (``tests.helpers.ClientConnection`` over a
``StringTransport``; the clock a ``task.Clock``):

twisted.web's ``Site`` is built without its form-body parse (``parsePOSTFormSubmission=False``:
the proxy never reads ``request.args``), its cheapest form.

``server``  a ``POST /v1/chat/completions`` with a small JSON body, answered at once by a
            resource that writes a fixed 30-byte JSON answer: the server's own cost (parse
            the head and body, build the request, write the answer's head and body)
``proxy``   the same request through the whole proxy (routing, the exchange, the summary;
            ``--log-file none``) to a ``tests.helpers.FakeUpstream`` that answers the same
            30 bytes

Each round times NUMBER requests per server with ``time.process_time``; the servers
alternate within every round, and every round is printed, then the best and the median.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import Site

from tests.helpers import ClientConnection, FakeResponse, FakeUpstream
from txlb import LoadBalancer
from txlb._server.lean import LeanSite
from txlb._server.site import ProxySite

JSON = [(b"content-type", b"application/json")]
BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
ANSWER = b'{"id":"x","choices":[],"ok":1}'


class _Answer(Resource):
    """Answers every request with the fixed JSON, as the proxy answers a small request."""

    isLeaf = True

    def render(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(ANSWER))
        return ANSWER


def _server_only(factory: Any) -> Callable[[], None]:
    client = ClientConnection(factory)

    def one() -> None:
        client.request(b"POST", b"/v1/chat/completions", headers=JSON, body=BODY)
        client.transport.clear()

    return one


def _through_proxy(lean: bool) -> Callable[[], None]:
    upstream = FakeUpstream()
    lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=Clock(), agent=upstream,
                      probe_agent=FakeUpstream(), log_file="none")
    # twisted.web's Site without its form-body parse (the proxy never reads request.args):
    # the cheapest twisted.web main port, so the figure is the lean server's gain alone
    factory = (lb.main_factory() if lean else
               ProxySite(lb.proxy, max_body=lb.config.max_body, reactor=lb.reactor,
                         parsePOSTFormSubmission=False))
    client = ClientConnection(factory)

    def one() -> None:
        client.request(b"POST", b"/v1/chat/completions", headers=JSON, body=BODY)
        response = upstream.calls.pop().respond(FakeResponse(200, JSON, length=len(ANSWER)))
        response.send(ANSWER)
        response.end()
        client.transport.clear()

    return one


def _round(one: Callable[[], None], number: int) -> float:
    start = time.process_time()
    for _ in range(number):
        one()
    return (time.process_time() - start) / number * 1e6


def main(argv: list[str]) -> None:
    number = int(argv[0]) if argv else 2000
    rounds = int(argv[1]) if len(argv) > 1 else 5
    clock = Clock()
    paths: dict[str, dict[str, Callable[[], None]]] = {
        "server": {"twisted.web": _server_only(Site(_Answer(), reactor=clock,
                                                    parsePOSTFormSubmission=False)),
                   "lean": _server_only(LeanSite(_Answer(), reactor=clock))},
        "proxy": {"twisted.web": _through_proxy(lean=False),
                  "lean": _through_proxy(lean=True)},
    }
    for path, servers in paths.items():
        for one in servers.values():
            _round(one, min(number, 200))  # warm up
        figures: dict[str, list[float]] = {name: [] for name in servers}
        for index in range(rounds):
            order = list(servers.items())
            if index % 2:
                order.reverse()  # alternate which goes first
            for name, one in order:
                figures[name].append(_round(one, number))
        for name, values in figures.items():
            rounds_text = " ".join(f"{v:.1f}" for v in values)
            print(f"{path:6} {name:11} µs/request: best {min(values):6.1f}  median "
                  f"{statistics.median(values):6.1f}   rounds: {rounds_text}")


if __name__ == "__main__":
    main(sys.argv[1:])
