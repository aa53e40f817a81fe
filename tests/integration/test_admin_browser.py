"""
The attacks on the admin port, made by a real headless Chromium: a page of another origin
submitting forms (and no-cors fetches) at it, and a DNS-rebound page reading and changing
it.  The admin port is served by the same Site as under ``twistd llmlb``; a recorder in
front of it says when the browser's requests have been answered, so the test checks the
outcome after the attack happened, not after some delay.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import defer, reactor, threads
from twisted.trial.unittest import TestCase
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from txlb import LoadBalancer
from txlb.tap import _AdminSite

from ..parts import missing
from .test_integration import Fleet
from .test_operations import CHROMEDRIVER, CHROMIUM

EVIL = "127.0.0.1:1"  # the backend the attacker would add: any address of their choosing

ATTACK_PAGE = """<!doctype html>
<html><body>
<iframe name="f1"></iframe><iframe name="f2"></iframe><iframe name="f3"></iframe>
<form id="drain" target="f1" method="POST" action="{admin}/backends/{first}/drain"></form>
<form id="add" target="f2" method="POST" enctype="text/plain" action="{admin}/backends">
  <input name='{{"backend": "{evil}", "models": ["' value='"]}}'>
</form>
<form id="multipart" target="f3" method="POST" enctype="multipart/form-data"
      action="{admin}/backends/{second}/drain"><input name="a" value="b"></form>
<script>
for (const id of ["drain", "add", "multipart"]) document.getElementById(id).submit();
// a "simple" request too: a Blob body has no Content-Type at all
fetch("{admin}/backends", {{method: "POST", mode: "no-cors",
                             body: new Blob(['{{"backend": "{evil}"}}'])}});
fetch("{admin}/backends/{second}/drain", {{method: "POST", mode: "no-cors"}});
</script>
</body></html>
"""
ATTACK_REQUESTS = 5

#: What the rebound page's script does once the name points at the admin port: it is
#: same-origin there, so it needs no form and no CORS.
REBOUND_SCRIPT = """
const done = arguments[arguments.length - 1];
const answer = async (path, init) => {
  const response = await fetch(path, init);
  return [response.status, await response.text()];
};
Promise.all([
  answer("/status"),
  answer("/backends/%(first)s/drain", {method: "POST"}),
  answer("/backends", {method: "POST", headers: {"Content-Type": "application/json"},
                       body: JSON.stringify({backend: "%(evil)s"})}),
]).then(done, error => done(String(error)));
"""


class _Recorder(Resource):
    """Passes every request on and remembers each answer's method, path and status."""

    isLeaf = True

    def __init__(self, inner: IResource) -> None:
        super().__init__()
        self._inner = inner
        self.answered: list[tuple[str, str, int]] = []

    def render(self, request: Request) -> Any:
        def record(_: object) -> None:
            self.answered.append((request.method.decode(), request.uri.decode(),
                                  int(request.code)))

        request.notifyFinish().addBoth(record)
        return self._inner.render(request)


class _AttackSite(Resource):
    isLeaf = True

    def __init__(self, page: bytes) -> None:
        super().__init__()
        self._page = page

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return self._page


class AdminBrowserAttackTests(TestCase):
    """
    Chromium and chromedriver come from Debian (``.ci/run`` installs them); without them
    the tests are skipped with a message saying so.
    """

    timeout = 120

    def setUp(self) -> None:
        if not (CHROMIUM and CHROMEDRIVER):
            missing("chromium", "Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver)")
        try:
            import selenium  # noqa: F401
        except ImportError:
            missing("selenium", "selenium is not installed (pip install '.[test]')")
        self.fleet = Fleet(self, 2)
        self.lb = LoadBalancer(self.fleet.keys, reactor=reactor, log_file="none")
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        self.recorder = _Recorder(self.lb.admin_resource())
        admin = reactor.listenTCP(0, _AdminSite(self.recorder), interface="127.0.0.1")
        self.addCleanup(admin.stopListening)
        self.admin_port = admin.getHost().port

    def assertNothingChanged(self) -> None:
        self.assertEqual(sorted(b.key for b in self.lb.pool), sorted(self.fleet.keys))
        self.assertEqual([b.key for b in self.lb.pool if b.health.draining], [])

    @defer.inlineCallbacks
    def test_cross_origin_forms_and_fetches_change_nothing(self) -> Any:
        first, second = self.fleet.keys
        page = ATTACK_PAGE.format(admin=f"http://127.0.0.1:{self.admin_port}", first=first,
                                  second=second, evil=EVIL).encode()
        attacker = reactor.listenTCP(0, Site(_AttackSite(page)), interface="127.0.0.1")
        self.addCleanup(attacker.stopListening)
        url = f"http://127.0.0.1:{attacker.getHost().port}/"  # another port: another origin

        def attacked() -> bool:
            return len(self.recorder.answered) >= ATTACK_REQUESTS

        yield threads.deferToThread(drive, [], url, attacked)
        answered = self.recorder.answered
        self.assertEqual(len(answered), ATTACK_REQUESTS, answered)
        self.assertEqual({status for _, _, status in answered} - {403, 415}, set(), answered)
        self.assertNothingChanged()

    @defer.inlineCallbacks
    def test_dns_rebound_page_reads_and_changes_nothing(self) -> Any:
        first = self.fleet.keys[0]
        # the browser resolves rebind.test to 127.0.0.1: the page at rebind.test:PORT is
        # then same-origin with the admin port, as after a real DNS rebinding
        flags = ["--host-resolver-rules=MAP rebind.test 127.0.0.1"]
        url = f"http://rebind.test:{self.admin_port}/"
        script = REBOUND_SCRIPT % {"first": first, "evil": EVIL}
        results = yield threads.deferToThread(drive, flags, url, None, script)
        self.assertIsInstance(results, list, results)
        for status, body in results:
            self.assertEqual(status, 403, body)
            self.assertEqual(json.loads(body)["error"]["code"], 403)
            for key in self.fleet.keys:
                self.assertNotIn(key, body)  # nothing of /status leaked
        hosts = {path: status for _, path, status in self.recorder.answered}
        self.assertEqual(hosts.get("/"), 403)  # the page itself was refused too
        self.assertNothingChanged()


def drive(flags: list[str], url: str, until: Any = None, script: str | None = None) -> Any:
    """
    Open ``url`` in headless Chromium, then wait (at most 30 s) for ``until()`` to hold or
    run ``script`` (asynchronous, in the page) and return what it answers.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", *flags):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    try:
        driver.set_script_timeout(30)
        driver.get(url)
        if until is not None:
            WebDriverWait(driver, 30, poll_frequency=0.05).until(lambda _: until())
        if script is not None:
            return driver.execute_async_script(script)
        return None
    finally:
        driver.quit()
