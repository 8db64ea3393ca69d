"""The response helpers: ``text_response`` and ``error_response`` send one ``content-type`` and
one ``content-length`` (the text's own), whatever fields the caller hands them.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``; the
helpers themselves are tested synchronously, with hypothesis; the wire tests
use a raw h1 client and a raw h2 client, which show every field as sent.
"""

from __future__ import annotations

import functools

import hpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from support import RawH2Client
from test_smuggling import exchange

from blocks import HTTPServer, Request, Response, error_response, serve_http, text_response

TEXT_PLAIN = b"text/plain; charset=utf-8"
OWN = (b"content-type", b"content-length")

names = st.sampled_from(
    [b"content-type", b"Content-Type", b"content-length", b"Content-Length", b"x-a", b"X-B", b"cache-control"]
)
values = st.text(alphabet="abcdefghij0123456789/;= ", max_size=12).map(str.encode)
fields = st.lists(st.tuples(names, values), max_size=6)


def check_one_of_each(response: Response, text: str, passed: list[tuple[bytes, bytes]]) -> None:
    lower = [(name.lower(), value) for name, value in passed]
    kinds = [value for name, value in lower if name == b"content-type"]
    headers = response.headers
    assert all(name == name.lower() for name, _ in headers), headers
    assert [v for n, v in headers if n == b"content-type"] == [kinds[-1] if kinds else TEXT_PLAIN]
    assert [v for n, v in headers if n == b"content-length"] == [b"%d" % len(text.encode())]
    # Every other field, as given and in order.
    assert [(n, v) for n, v in headers if n not in OWN] == [(n, v) for n, v in lower if n not in OWN]


@given(text=st.text(max_size=40), headers=st.none() | fields)
def test_text_response_has_one_content_type_and_its_own_length(
    text: str, headers: list[tuple[bytes, bytes]] | None
) -> None:
    response = text_response(200, text, headers)
    check_one_of_each(response, text, headers or [])
    assert response.body.length == len(text.encode())


def test_text_response_passes_a_field_on_as_given() -> None:
    """A never-indexed field (a request id, hpack's NeverIndexedHeaderTuple) stays one."""
    request_id = hpack.NeverIndexedHeaderTuple(b"x-request-id", b"1f2e")
    response = text_response(200, "ok\n", [request_id, (b"X-B", b"v")])
    assert response.headers[2] is request_id
    assert response.headers[3] == (b"x-b", b"v")


@given(status=st.sampled_from([400, 404, 413, 429, 503]), headers=fields)
def test_error_response_has_one_content_type_and_its_own_length(
    status: int, headers: list[tuple[bytes, bytes]]
) -> None:
    response = error_response(status, headers, hop="edge")
    assert response.status == status
    assert response.body.length is not None
    length = [v for n, v in response.headers if n == b"content-length"]
    assert length == [b"%d" % response.body.length]
    assert len([v for n, v in response.headers if n == b"content-type"]) == 1


PAGE = "<p>hello</p>\n"
GIVEN = [(b"Content-Type", b"text/html; charset=utf-8"), (b"content-length", b"999"), (b"x-replica", b"r0")]


async def page(request: Request) -> Response:
    """A caller that hands text_response its own content-type (cased as a browser shows it) and a stale length."""
    return text_response(200, PAGE, GIVEN)


@pytest.mark.parametrize("protocol", ["h1", "h2"])
async def test_on_the_wire_a_text_response_carries_one_content_type_and_one_length(
    nursery: trio.Nursery, protocol: str
) -> None:
    with trio.fail_after(10):
        server: HTTPServer = await nursery.start(functools.partial(serve_http, page))
        if protocol == "h1":
            result = await exchange(server.port, b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
            reply = result.replies[0]
            status, headers, body = reply.status, reply.headers, reply.body
        else:
            async with RawH2Client.open(server.port) as client:
                answer = await client.request(client.head(b"GET", b"/"))
            assert answer.reset is None and not answer.connection_lost
            status, headers, body = answer.status, answer.headers, answer.body
    assert status == 200
    assert body == PAGE.encode()
    assert [v for n, v in headers if n == b"content-type"] == [b"text/html; charset=utf-8"]
    assert [v for n, v in headers if n == b"content-length"] == [b"%d" % len(PAGE)]
    assert [v for n, v in headers if n == b"x-replica"] == [b"r0"]
