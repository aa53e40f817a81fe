"""
Operations on real sockets: draining with a stream in flight, the admin port of the real
process, graceful SIGTERM, and the dashboard in a real headless browser.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, threads
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from txlb import LoadBalancer
from txlb.tap import Options, makeService

from ..parts import missing
from ..processes import (
    ROOT,
    Chunks,
    Client,
    TwistdProcess,
    chat_body,
    header,
    wait_until,
)
from .test_integration import JSON, Fleet

STREAM_TOKENS = 40


def expected_events(tokens: int) -> int:
    return tokens + 3  # role chunk, one per token, finish chunk, [DONE]


class DrainWithStreamTests(TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def test_drained_backend_finishes_its_stream(self) -> Any:
        fleet = Fleet(self, 2, tokens_per_second=80)
        lb = LoadBalancer(fleet.keys, reactor=reactor, log_file="none")
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        main = reactor.listenTCP(0, Site(lb.resource()), interface="127.0.0.1")
        admin = reactor.listenTCP(0, Site(lb.admin_resource()), interface="127.0.0.1")
        self.addCleanup(main.stopListening)
        self.addCleanup(admin.stopListening)
        url = f"http://127.0.0.1:{main.getHost().port}"
        admin_url = f"http://127.0.0.1:{admin.getHost().port}"
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)

        response = yield defer.ensureDeferred(client.request(
            url + "/v1/chat/completions", b"POST", chat_body(),
            {**JSON, b"x-sim-tokens": [str(STREAM_TOKENS).encode()]}))
        streaming = header(response, b"x-backend")
        stream = Chunks()
        response.deliverBody(stream)
        yield defer.ensureDeferred(wait_until(lambda: len(stream.chunks) > 2, what="tokens"))

        drained, body = yield defer.ensureDeferred(client.fetch(
            f"{admin_url}/backends/{streaming}/drain", b"POST"))
        state = json.loads(body.body)
        self.assertEqual((drained.code, state["draining"], state["active"]), (200, True, 1))
        for _ in range(3):
            other, _ = yield defer.ensureDeferred(client.fetch(url + "/metrics"))
            self.assertNotEqual(header(other, b"x-backend"), streaming)

        yield stream.done
        self.assertTrue(stream.clean)
        events = [e for e in stream.body.split(b"\n\n") if e]
        self.assertEqual(len(events), expected_events(STREAM_TOKENS))
        self.assertEqual(events[-1], b"data: [DONE]")
        _, body = yield defer.ensureDeferred(client.fetch(admin_url + "/status"))
        entry = next(b for b in json.loads(body.body)["backends"] if b["backend"] == streaming)
        self.assertEqual((entry["draining"], entry["active"]), (True, 0))


class ProcessLifecycleTests(TestCase):
    timeout = 90

    @defer.inlineCallbacks
    def start(self, *args: str) -> Any:
        self.fleet = Fleet(self, 2, tokens_per_second=50)
        self.lb = TwistdProcess("--backends", ",".join(self.fleet.keys),
                                "--admin", "tcp:0:interface=127.0.0.1", *args)
        self.addCleanup(lambda: defer.ensureDeferred(self.lb.stop()))
        yield defer.ensureDeferred(self.lb.started())
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)

    @defer.inlineCallbacks
    def open_stream(self, tokens: int) -> Any:
        response = yield defer.ensureDeferred(self.client.request(
            self.lb.url + "/v1/chat/completions", b"POST", chat_body(),
            {**JSON, b"x-sim-tokens": [str(tokens).encode()]}))
        stream = Chunks()
        response.deliverBody(stream)
        yield defer.ensureDeferred(wait_until(lambda: len(stream.chunks) > 1, what="tokens"))
        return stream

    @defer.inlineCallbacks
    def test_sigterm_lets_the_stream_finish_then_exits_0(self) -> Any:
        yield self.start("--admin-token", "tok")
        _, status = yield defer.ensureDeferred(self.client.fetch(
            self.lb.admin_url + "/status", headers={b"authorization": [b"Bearer tok"]}))
        self.assertEqual(json.loads(status.body)["total"], 2)
        stream = yield self.open_stream(STREAM_TOKENS)
        self.lb.process.send_signal(signal.SIGTERM)
        # while the stream drains, the admin port still answers (and shows it in flight)
        yield defer.ensureDeferred(wait_until(lambda: "received SIGTERM" in self.lb.output(),
                                              what="the signal"))
        draining, status = yield defer.ensureDeferred(self.client.fetch(
            self.lb.admin_url + "/status", headers={b"authorization": [b"Bearer tok"]}))
        self.assertEqual(draining.code, 200)
        self.assertEqual(json.loads(status.body)["in_flight"], 1)
        yield stream.done
        self.assertTrue(stream.clean)
        events = [e for e in stream.body.split(b"\n\n") if e]
        self.assertEqual(len(events), expected_events(STREAM_TOKENS))
        code = yield defer.ensureDeferred(self.lb.stop(signal_it=False))
        self.assertEqual(code, 0, self.lb.final_output)
        self.assertIn("received SIGTERM", self.lb.final_output)
        self.assertNotIn("tok", self.lb.final_output.replace("tokens", "").replace(
            "stop", "").replace("Stopping", ""))  # the token is never logged

    @defer.inlineCallbacks
    def test_shutdown_timeout_cuts_what_is_left(self) -> Any:
        yield self.start("--shutdown-timeout", "0.5", "--log-file", "-")
        stream = yield self.open_stream(100_000)
        self.lb.process.send_signal(signal.SIGTERM)
        yield stream.done
        self.assertFalse(stream.clean)  # truncated, never a fake clean end
        code = yield defer.ensureDeferred(self.lb.stop(signal_it=False))
        self.assertEqual(code, 0, self.lb.final_output)
        self.assertIn(" end=shutdown ", self.lb.final_output)
        yield defer.ensureDeferred(wait_until(
            lambda: sum(s.aborted for s in self.fleet.sims) == 1, what="upstream abort"))


class AdminExposureWarningTests(SynchronousTestCase):
    def warnings_for(self, *args: str) -> list[str]:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        options = Options()
        options.parseOptions(["--backends", "127.0.0.1:1", "--log-file", "none", *args])
        makeService(options)  # built, never started: nothing listens
        return [str(e.get("log_format")) for e in events
                if "reachable from other machines" in str(e.get("log_format"))]

    def test_warns_when_exposed_without_token(self) -> None:
        self.assertEqual(len(self.warnings_for("--admin", "tcp:9999")), 1)
        self.assertEqual(len(self.warnings_for("--admin", "tcp:9999:interface=0.0.0.0")), 1)

    def test_quiet_on_loopback_or_with_token(self) -> None:
        self.assertEqual(self.warnings_for(), [])
        self.assertEqual(self.warnings_for("--admin", "9999"), [])
        self.assertEqual(self.warnings_for("--admin", "tcp:9999", "--admin-token", "t"), [])


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"


class DashboardBrowserTests(TestCase):
    """
    The status page in real headless Chromium: it loads, shows the table, and its drain
    button drains.  Chromium comes from Debian (``.ci/run`` installs it); without it the
    test is skipped with a message saying so.
    """

    timeout = 120

    def setUp(self) -> None:
        if not (CHROMIUM and CHROMEDRIVER):
            missing("chromium" if not CHROMIUM else "chromedriver",
                    "Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver)")
        try:
            import selenium  # noqa: F401
        except ImportError:
            missing("selenium", "selenium is not installed (pip install '.[test]')")

    @defer.inlineCallbacks
    def test_page_shows_backends_charts_and_drains(self) -> Any:
        # different speeds, so the charts have something to tell apart
        fleets = [Fleet(self, 1, ttft=ttft, tokens_per_second=rate)
                  for ttft, rate in ((0.02, 400), (0.08, 200), (0.25, 100))]
        keys = [key for fleet in fleets for key in fleet.keys]
        lb = LoadBalancer(keys, reactor=reactor, log_file="none", slow_start=60)
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        admin = reactor.listenTCP(0, Site(lb.admin_resource()), interface="127.0.0.1")
        self.addCleanup(admin.stopListening)
        proxy = reactor.listenTCP(0, Site(lb.resource()), interface="127.0.0.1")
        self.addCleanup(proxy.stopListening)
        traffic = _Traffic(f"http://127.0.0.1:{proxy.getHost().port}")
        self.addCleanup(traffic.stop)
        traffic.start()
        url = f"http://127.0.0.1:{admin.getHost().port}/"
        screenshot = SCREENSHOT if os.environ.get("TXLB_UPDATE_SCREENSHOT") else \
            Path(self.mktemp()).resolve().with_suffix(".png")
        # The browser is driven from a thread: the reactor must keep serving the page.
        seen = yield threads.deferToThread(drive_dashboard, url, keys[1], str(screenshot))
        rows, state_after, charts = seen
        self.assertEqual([row[0] for row in rows], keys)
        self.assertEqual({row[1] for row in rows}, {"up"})
        self.assertEqual(state_after, "draining")
        self.assertTrue(lb.pool.get(keys[1]).health.draining)  # type: ignore[union-attr]
        self.assertFalse(lb.pool.get(keys[0]).health.draining)  # type: ignore[union-attr]
        # the fleet's charts and every backend's sparklines are drawn, and they move
        first, later = charts
        self.assertGreater(later["samples"], first["samples"])
        self.assertNotEqual(later["rate"], first["rate"])
        self.assertTrue(later["rate"].startswith("M"), later)
        self.assertTrue(later["ttfb"].startswith("M"), later)
        self.assertEqual(later["sparklines"], 2 * len(keys))
        self.assertGreater(traffic.done, 0)
        self.assertGreater(screenshot.stat().st_size, 1000)


class _Traffic:
    """
    Requests to the proxy while the browser looks: a few at a time, bounded in count and
    in time, stopped by the test's cleanup.
    """

    MAX_REQUESTS = 20000
    MAX_SECONDS = 120.0
    CONCURRENCY = 4

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = Client()
        self.done = 0
        self.stopping = False
        self.running: list[defer.Deferred[None]] = []
        self.deadline = 0.0

    def start(self) -> None:
        self.deadline = reactor.seconds() + self.MAX_SECONDS  # type: ignore[attr-defined]
        self.running = [defer.ensureDeferred(self._loop(index))
                        for index in range(self.CONCURRENCY)]

    async def _loop(self, index: int) -> None:
        tokens = [b"4", b"12", b"40", b"8"][index % 4]
        while (not self.stopping and self.done < self.MAX_REQUESTS
               and reactor.seconds() < self.deadline):  # type: ignore[attr-defined]
            headers = {**JSON, b"x-sim-tokens": [tokens]}
            if self.done % 25 == 24:
                headers[b"x-sim-status"] = [b"500"]  # a few 5xx, as a real fleet has
            await self.client.fetch(self.url + "/v1/chat/completions", b"POST",
                                    chat_body(), headers)
            self.done += 1

    def stop(self) -> defer.Deferred[Any]:
        self.stopping = True
        done = defer.DeferredList(self.running, consumeErrors=True)
        done.addCallback(lambda _: self.client.pool.closeCachedConnections())
        return done


#: What the page's charts hold: samples drawn, the fleet charts' first lines, sparklines.
READ_CHARTS = """
const path = id => {
  const line = document.querySelector('#' + id + ' svg path.s1');
  return line ? line.getAttribute('d') : '';
};
return {samples: Number(document.querySelector('#fleet-rate svg').dataset.samples || 0),
        rate: path('fleet-rate'), ttfb: path('fleet-ttfb'),
        sparklines: document.querySelectorAll('#backends svg.spark path.s1').length};
"""


def drive_dashboard(url: str, backend: str, screenshot: str,
                    ) -> tuple[list[list[str]], str, list[dict[str, Any]]]:
    """
    Load the page, read the table, watch the charts move, click drain on ``backend``,
    read its new state, and take the screenshot.
    """
    from selenium import webdriver
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1400,600"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    try:
        driver.get(url)
        # The page re-renders its table every 2 s, so an element found a moment ago may
        # be gone: waits retry on stale elements, and the table is read in one script.
        wait = WebDriverWait(driver, 20, ignored_exceptions=(
            NoSuchElementException, StaleElementReferenceException))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#backends tr")) == 3)
        rows: list[list[str]] = driver.execute_script(
            "return [...document.querySelectorAll('#backends tr')]"
            ".map(row => [...row.cells].map(cell => cell.textContent))")
        # the history fills one sample a second; the page asks every 2 s
        wait.until(lambda d: d.execute_script(READ_CHARTS)["samples"] >= 3)
        first = driver.execute_script(READ_CHARTS)
        wait.until(lambda d: d.execute_script(READ_CHARTS)["samples"] >= first["samples"] + 2)
        later = driver.execute_script(READ_CHARTS)

        def click_drain(d: Any) -> bool:
            d.find_element(By.CSS_SELECTOR, f'tr[data-backend="{backend}"] button').click()
            return True

        wait.until(click_drain)
        selector = f'tr[data-backend="{backend}"] td[data-field="state"]'
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, selector).text == "draining")
        state = "draining"
        # a minute of history for the picture in the docs, so it shows lines, not dots
        settle = 60 if os.environ.get("TXLB_UPDATE_SCREENSHOT") else 0
        WebDriverWait(driver, settle + 20).until(
            lambda d: d.execute_script(READ_CHARTS)["samples"] >= settle)
        driver.save_screenshot(screenshot)
        return rows, state, [first, later]
    finally:
        driver.quit()
