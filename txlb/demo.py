"""
``python -m txlb.demo``: the balancer in front of eight simulated vLLM backends, in one
process, so a newcomer sees txlb work before owning a GPU.

It starts the simulators on free loopback ports (never a fixed port another program may
hold), the balancer on ``--listen`` (default ``tcp:8000:interface=127.0.0.1``), streams
one chat completion through it for all to see, and keeps serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from twisted.internet import defer, endpoints, error, task
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from twisted.web.server import Site

from txlb._balancer import LoadBalancer
from txlb._config.endpoints import parse_listen
from txlb._config.errors import ConfigError
from txlb._server.reactor import install_by_default
from txlb._upstream.agent import BytesProducer
from txlb.testing.engine import SimulatedVLLM, listen_simulated

MODEL = "sim-model"


class _PrintTokens(Protocol):
    """Prints the content of each SSE event as it arrives, to show streaming is live."""

    def __init__(self, done: defer.Deferred[None]) -> None:
        self._done = done
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                continue
            for choice in json.loads(payload).get("choices", []):
                sys.stdout.write(choice.get("delta", {}).get("content") or "")
                sys.stdout.flush()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        sys.stdout.write("\n")
        if reason.check(ResponseDone):
            self._done.callback(None)
        else:
            self._done.errback(reason)


async def _stream_one(reactor: Any, url: str) -> None:
    body = json.dumps({
        "model": MODEL, "stream": True,
        "messages": [{"role": "user", "content": "Say hello through the balancer."}],
    }).encode()
    response: IResponse = await Agent(reactor).request(
        b"POST", f"{url}/v1/chat/completions".encode(),
        Headers({b"content-type": [b"application/json"]}), BytesProducer(body),
    )
    backend = (response.headers.getRawHeaders(b"x-backend") or [b"?"])[0].decode()
    print(f"HTTP {response.code}, X-Backend: {backend}; tokens as they stream:")
    done: defer.Deferred[None] = defer.Deferred()
    response.deliverBody(_PrintTokens(done))
    await done


async def _main(reactor: Any, argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m txlb.demo", description=__doc__)
    parser.add_argument("--listen", default="tcp:8000:interface=127.0.0.1",
                        help="where the balancer listens (port or Twisted endpoint)")
    parser.add_argument("--admin", default="tcp:8001:interface=127.0.0.1",
                        help="where the admin API and status page listen")
    parser.add_argument("--backends", type=int, default=8, help="simulated backends")
    args = parser.parse_args(argv)
    try:
        listen = parse_listen("listen", args.listen)
    except ConfigError as problem:
        raise SystemExit(f"txlb demo: {problem}") from None

    sims = [SimulatedVLLM(reactor, models=(MODEL,), tokens_per_second=20.0)
            for _ in range(args.backends)]
    ports: list[int] = [listen_simulated(reactor, sim).getHost().port  # type: ignore[attr-defined]
                        for sim in sims]
    balancer = LoadBalancer([f"127.0.0.1:{port}" for port in ports], reactor=reactor,
                            listen=listen, health_interval=2)
    try:
        listening = await endpoints.serverFromString(reactor, listen).listen(
            balancer.main_factory())
    except error.CannotListenError as problem:
        raise SystemExit(
            f"txlb demo: cannot listen on {listen}: {problem.socketError}. Something else "
            f"holds that port; pick another, e.g. --listen tcp:8100:interface=127.0.0.1"
        ) from None
    balancer.service().startService()
    try:
        admin = await endpoints.serverFromString(reactor, args.admin).listen(
            Site(balancer.admin_resource()))
        admin_url = f"http://127.0.0.1:{admin.getHost().port}/"
    except error.CannotListenError as problem:
        admin_url = f"(not started: {args.admin} is taken: {problem.socketError})"
    port = listening.getHost().port
    url = f"http://127.0.0.1:{port}"
    print(f"txlb demo: {len(sims)} simulated vLLM backends on 127.0.0.1 ports "
          f"{', '.join(map(str, ports))}")
    print(f"txlb demo: balancer listening on {url}")
    print(f"txlb demo: status page and admin API on {admin_url}")
    await _stream_one(reactor, url)
    print(f"\nTry it yourself (Ctrl-C here to stop):\n"
          f"  curl -sN -i {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{MODEL}\", \"stream\": true, "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'\n"
          f"  curl -s {url}/__lb_status")
    await defer.Deferred()  # serve until interrupted


def main(argv: list[str] | None = None) -> None:
    install_by_default()  # the reactor ``twistd -n llmlb`` runs on, unless one is installed
    # Ctrl-C stops the demo even when it was started with SIGINT ignored (a shell's
    # background job, or a script that ignores it): Twisted puts its own handler only over
    # Python's default one, and would otherwise leave Ctrl-C ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    task.react(lambda reactor: defer.ensureDeferred(_main(reactor, argv or sys.argv[1:])))


if __name__ == "__main__":
    main()
