"""
The head translation as pure functions: values in, values out, no request or transport.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from txlb._proxy.head import ClientHead, UpstreamHead, client_head, origin_form, upstream_head


class OriginFormTests(SynchronousTestCase):
    def test_path_and_query_as_written(self) -> None:
        self.assertEqual(origin_form(b"/v1/x?a=%2F&b"), b"/v1/x?a=%2F&b")

    def test_absolute_form_becomes_origin_form(self) -> None:
        self.assertEqual(origin_form(b"http://gpu:8000/v1/models?x=1"), b"/v1/models?x=1")
        self.assertEqual(origin_form(b"HTTPS://gpu/v1"), b"/v1")
        self.assertEqual(origin_form(b"http://gpu?q=1"), b"/?q=1")
        self.assertEqual(origin_form(b"http://gpu"), b"/")
        # an empty authority: what follows the "//" is the target
        self.assertEqual(origin_form(b"http:///v1/models"), b"/v1/models")
        self.assertEqual(origin_form(b"http://?q=1"), b"/?q=1")

    def test_mount_point_dropped(self) -> None:
        self.assertEqual(origin_form(b"/llm/v1/chat?s=1", mounted=1), b"/v1/chat?s=1")
        self.assertEqual(origin_form(b"/a/b/v1", mounted=2), b"/v1")


class UpstreamHeadTests(SynchronousTestCase):
    def test_head_for_the_backend(self) -> None:
        head = upstream_head(
            b"POST", b"/llm/v1/chat?x=1", 1,
            [(b"host", b"lb"), (b"content-length", b"2"), (b"expect", b"100-continue"),
             (b"connection", b"x-hop"), (b"x-hop", b"1"), (b"keep-alive", b"5"),
             (b"x-custom", b"one"), (b"x-custom", b"two"),
             (b"x-forwarded-for", b"10.0.0.1"), (b"x-forwarded-proto", b"https")],
            "192.0.2.7", b"http")
        self.assertEqual(head, UpstreamHead(b"POST", b"/v1/chat?x=1", [
            (b"x-custom", b"one"), (b"x-custom", b"two"),
            (b"x-forwarded-for", b"10.0.0.1, 192.0.2.7"), (b"x-forwarded-proto", b"http"),
        ]))


class ClientHeadTests(SynchronousTestCase):
    def head(self, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None,
             length: int | None = 5, method: bytes = b"GET",
             backend: tuple[str, int] | None = ("10.0.0.2:8000", 8000)) -> ClientHead:
        return client_head(status, method, headers or [], length, backend)

    def test_end_to_end_headers_grouped_in_order(self) -> None:
        head = self.head(headers=[
            (b"content-type", b"text/event-stream"), (b"set-cookie", b"a"),
            (b"connection", b"x-hop"), (b"x-hop", b"1"), (b"transfer-encoding", b"chunked"),
            (b"set-cookie", b"b"), (b"content-type", b"text/plain"),
        ], length=None)
        self.assertEqual(head.headers, [
            (b"content-type", [b"text/event-stream", b"text/plain"]),
            (b"set-cookie", [b"a", b"b"]),
            (b"x-backend", [b"10.0.0.2:8000"]), (b"x-backend-port", [b"8000"]),
        ])
        self.assertEqual(head.content_type, b"text/event-stream")

    def test_length_from_the_body_read(self) -> None:
        head = self.head(headers=[(b"content-length", b"999")], length=5, backend=None)
        self.assertEqual(head.headers, [(b"content-length", [b"5"])])

    def test_no_length_for_a_stream(self) -> None:
        self.assertEqual(self.head(length=None, backend=None).headers, [])

    def test_head_and_304_keep_the_backends_length(self) -> None:
        for status, method in [(200, b"HEAD"), (304, b"GET")]:
            head = self.head(status, [(b"content-length", b"42"), (b"content-length", b"42")],
                             length=0, method=method, backend=None)
            self.assertEqual(head.headers, [(b"content-length", [b"42"])])
        self.assertEqual(self.head(304, length=0, backend=None).headers, [])

    def test_204_carries_no_length(self) -> None:
        head = self.head(204, [(b"content-length", b"0")], length=0, backend=None)
        self.assertEqual(head.headers, [])

    def test_backends_date_and_server_replace_the_requests(self) -> None:
        head = self.head(headers=[(b"connection", b"date"), (b"date", b"D"),
                                  (b"server", b"vllm")], backend=None)
        # even a Date that Connection names: the Request would otherwise write its own
        self.assertEqual(head.headers, [(b"server", [b"vllm"]), (b"date", [b"D"]),
                                        (b"content-length", [b"5"])])

    def test_x_backend_replaces_the_backends_own(self) -> None:
        head = self.head(headers=[(b"x-backend", b"inner"), (b"x-backend-port", b"1")])
        self.assertEqual(dict(head.headers)[b"x-backend"], [b"10.0.0.2:8000"])
        self.assertEqual(dict(head.headers)[b"x-backend-port"], [b"8000"])

    def test_hidden_backend_drops_the_backends_own_too(self) -> None:
        head = self.head(headers=[(b"x-backend", b"inner"), (b"x-backend-port", b"1")],
                         backend=None)
        self.assertEqual(head.headers, [(b"content-length", [b"5"])])

    def test_status_kept(self) -> None:
        self.assertEqual(self.head(418).status, 418)


class AbsoluteFormTests(SynchronousTestCase):
    """Mutants of ``_proxy/head`` that survived its full run (mutation-full/)."""

    def test_an_absolute_form_target_keeps_a_url_inside_its_query(self) -> None:
        """Only the first ``://`` is the scheme's: a redirect URL in the query is data."""
        from txlb._proxy.head import origin_form

        self.assertEqual(origin_form(b"http://h:8000/cb?next=http://x/y"),
                         b"/cb?next=http://x/y")
