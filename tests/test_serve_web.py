"""`llama-chat serve` facing the web and the network: no web page reaches it (Host, Origin and
Content-Type checks; CORS for the pages named), connections that cannot pile up (head and body
timeouts, --max-connections), TCP_NODELAY, one access line per request, a clean stop, and the small
refusals: sampling values that overflow, server paths in errors, imports checked as they arrive."""

from __future__ import annotations

import http.client
import json

import pytest

from served import MODEL, Served, error_of

PAGE = "http://app.example"  # the one web page the shared server lets in

# every route, with the kind of body it takes; {id} is a stored session
ROUTES = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", "json"),
    ("GET", "/v1/sessions", None),
    ("POST", "/v1/sessions", "json"),
    ("POST", "/v1/sessions/import", "file"),
    ("GET", "/v1/sessions/{id}", None),
    ("DELETE", "/v1/sessions/{id}", None),
    ("POST", "/v1/sessions/{id}/fork", "json"),
    ("GET", "/v1/sessions/{id}/export", None),
]
POSTS = [r for r in ROUTES if r[2]]
# what a web page may send without a CORS preflight: a browser asks nobody before sending these
SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]


@pytest.fixture(scope="module")
def web(tmp_path_factory, tiny_model_paths):
    folder = tmp_path_factory.mktemp("web")
    s = Served(folder / "chat.db", tiny_model_paths["qwen2"], allowed_hosts=("chat.example",), cors_origins=(PAGE,))
    s.wait_ready()
    s.sid = json.loads(s.raw("POST", "/v1/sessions", b'{"title": "kept"}')[2])["id"]
    s.ask("hello there", extra_body={"session": s.sid}, max_tokens=4)
    s.file = s.raw("GET", f"/v1/sessions/{s.sid}/export")[2]
    yield s
    s.stop()


def send(s: Served, method: str, path: str, kind: str | None, **headers):
    """(status, headers, body) of the route's request with a body of its kind (a valid one: only the
    headers may be wrong); a header given as None is not sent (http.client adds no Content-Type)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    data = s.file if kind == "file" else json.dumps(body).encode() if kind else None
    default = {"file": "application/octet-stream", "json": "application/json", None: None}[kind]
    headers = {"Content-Type": default, **headers}
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path.format(id=s.sid), data, {k: v for k, v in headers.items() if v is not None})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def stored(s: Served) -> list:
    """Every session and its messages: what a refused request must not change."""
    store = s.state.engine.store
    return [(x.id, x.head_id, len(store.path(x.head_id))) for x in store.list_sessions()]


# -- Host: DNS rebinding ------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "kind"), ROUTES)
def test_a_request_naming_another_host_is_refused_on_every_route(web, method, path, kind):
    before = stored(web)
    for host in ("attacker.example", f"attacker.example:{web.url.rsplit(':', 1)[1]}", "127.0.0.1.nip.io"):
        status, error = error_of(send(web, method, path, kind, Host=host))
        assert status == 403 and error["code"] == "host_not_allowed" and "--allowed-host" in error["message"]
    assert stored(web) == before


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1", "127.0.0.1:{port}", "[::1]:{port}",
                                  "localhost.:{port}", "chat.example", "chat.example:{port}"])
def test_loopback_names_and_allowed_hosts_are_answered(web, host):
    status, _, body = web.raw("GET", "/v1/models", headers={"Host": host.format(port=web.url.rsplit(":", 1)[1])})
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_allowed_host_star_answers_any_name(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, allowed_hosts=("*",))
    try:
        assert s.raw("GET", "/health", headers={"Host": "anything.example"})[0] in (200, 503)
    finally:
        s.stop()


# -- Origin: pages in the user's browser (CSRF) --------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "kind"), ROUTES)
def test_a_request_from_another_web_page_is_refused_on_every_route(web, method, path, kind):
    before = stored(web)
    for origin in ("http://evil.example", "null", f"{PAGE}:8080", "https://app.example"):
        status, headers, body = send(web, method, path, kind, Origin=origin)
        assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
        assert "Access-Control-Allow-Origin" not in headers  # the page may not even read the refusal
    assert stored(web) == before


@pytest.mark.parametrize(("method", "path", "kind"), POSTS)
@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
def test_a_body_a_page_may_send_unasked_is_refused_on_every_post(web, method, path, kind, content_type):
    before = stored(web)
    status, error = error_of(send(web, method, path, kind, **{"Content-Type": content_type}))
    assert status == 415 and error["code"] == "unsupported_media_type"
    assert stored(web) == before


@pytest.mark.parametrize(("method", "path", "kind"), POSTS)
def test_each_post_takes_its_own_kind_of_body_only(web, method, path, kind):
    right, other = ("application/octet-stream", "application/json") if kind == "file" else ("application/json", "application/octet-stream")
    before = stored(web)
    status, error = error_of(send(web, method, path, kind, **{"Content-Type": other}))
    assert status == 415 and f"'Content-Type: {right}'" in error["message"]
    assert stored(web) == before
    status, _, _ = send(web, method, path, kind, **{"Content-Type": f"{right.upper()}; charset=utf-8"})
    assert status in (200, 201)  # the right kind, however written, is served


def test_the_page_named_by_cors_origin_may_use_the_api_from_a_browser(web):
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    status, headers, _ = web.raw("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "x-stainless-os" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, body = send(web, "POST", "/v1/chat/completions", "json", Origin=PAGE)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert json.loads(body)["choices"][0]["message"]["content"] is not None
    assert "X-Session-Id" in headers["Access-Control-Expose-Headers"]
    status, headers, _ = web.raw("OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_without_cors_origin_no_page_is_let_in(served):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    status, headers, _ = served.raw("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_the_openai_client_is_served_as_before(web):
    assert [m.id for m in web.client.models.list()] == [MODEL]
    assert web.ask("hi", max_tokens=3).choices[0].message.content is not None
