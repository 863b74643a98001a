"""`llama-chat serve` facing the web and the network: no web page reaches it (Host, Origin and
Content-Type checks; CORS for the pages named), connections that cannot pile up (head and body
timeouts, --max-connections), TCP_NODELAY, one access line per request, a clean stop, and the small
refusals: sampling values that overflow, server paths in errors, imports checked as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from llama_chat.app.cli import build_parser, main
from llama_chat.app.serve.app import LOOPBACK_NAMES, HostCheck
from llama_chat.app.serve.server import options_from
from llama_chat.app.serve.state import MAX_CONNECTIONS
from llama_chat.inference.activation_modes import DEFAULT_ACTIVATIONS
from llama_chat.storage.exchange import HEADER_SIZE
from llama_chat.storage.exchange.format import pack_header
from served import MODEL, Served, StderrLines, error_of, upload, wait_for

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
    s = Served(
        folder / "chat.db", tiny_model_paths["qwen2"], allowed_hosts=("chat.example",), cors_origins=(PAGE,)
    )
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
    store = s.state.sessions.store
    return [(x.id, x.head_id, len(store.path(x.head_id))) for x in store.list_sessions()]


# -- Host: DNS rebinding ------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "kind"), ROUTES)
def test_a_request_naming_another_host_is_refused_on_every_route(web, method, path, kind):
    before = stored(web)
    for host in ("attacker.example", f"attacker.example:{web.url.rsplit(':', 1)[1]}", "127.0.0.1.nip.io"):
        status, error = error_of(send(web, method, path, kind, Host=host))
        assert status == 403 and error["code"] == "host_not_allowed" and "--allowed-host" in error["message"]
    assert stored(web) == before


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST:{port}",
        "127.0.0.1",
        "127.0.0.1:{port}",
        "[::1]:{port}",
        "localhost.:{port}",
        "chat.example",
        "chat.example:{port}",
    ],
)
def test_loopback_names_and_allowed_hosts_are_answered(web, host):
    status, _, body = web.raw(
        "GET", "/v1/models", headers={"Host": host.format(port=web.url.rsplit(":", 1)[1])}
    )
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def test_the_address_a_client_reached_is_answered_as_its_host():
    """A server on 0.0.0.0 reached at 10.1.2.3 answers Host: 10.1.2.3, not another address or name."""
    answered = []

    async def app(scope, receive, send):
        answered.append(scope["path"])

    async def ask(host: str) -> None:
        scope = {
            "type": "http",
            "path": host,
            "server": ("10.1.2.3", 8080),
            "headers": [(b"host", host.encode())],
        }

        async def send(message):
            pass

        await HostCheck(app, {*LOOPBACK_NAMES, "0.0.0.0"})(scope, None, send)

    for host in (
        "10.1.2.3:8080",
        "10.1.2.3",
        "10.9.9.9:8080",
        "0.0.0.0:8080",
        "nas.example:8080",
        "localhost",
    ):
        asyncio.run(ask(host))
    assert answered == ["10.1.2.3:8080", "10.1.2.3", "0.0.0.0:8080", "localhost"]


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
    right, other = (
        ("application/octet-stream", "application/json")
        if kind == "file"
        else ("application/json", "application/octet-stream")
    )
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
    allowed = headers["Access-Control-Allow-Headers"].lower()
    assert "authorization" in allowed and "x-stainless-os" in allowed
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


# -- connections ---------------------------------------------------------------------------------------


def address(s: Served) -> tuple[str, int]:
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (read until it does; the socket's timeout bounds it)."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def response_of(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response a raw socket receives."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def test_accepted_connections_send_without_waiting_for_the_clients_ack(served):
    """TCP_NODELAY on: without it each response after the first on a kept-alive connection waits
    for the client's delayed ACK (40 ms)."""
    conn = http.client.HTTPConnection(*address(served))
    for _ in range(2):
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read()
    sockets = [c.transport.get_extra_info("socket") for c in list(served.server.server_state.connections)]
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    conn.close()


def test_connections_that_send_no_whole_request_are_closed(tmp_path, qwen2):
    s = Served(
        tmp_path / "chat.db", qwen2, header_timeout_s=0.5, keep_alive_s=0.5, body_timeout_s=0.5
    ).wait_ready()
    try:
        idle = socket.create_connection(address(s), timeout=30)
        assert closed_by_server(idle)

        slow = socket.create_connection(address(s), timeout=30)
        slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        stop = threading.Event()

        def trickle():  # a header line now and then: each arrives in time, the head never does
            for _ in range(400):
                if stop.wait(0.05):
                    return
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    return

        thread = threading.Thread(target=trickle)
        thread.start()
        assert closed_by_server(slow)
        stop.set()
        thread.join()

        body = socket.create_connection(address(s), timeout=30)
        body.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"title\": ")
        status, response = response_of(body)
        assert status == 408 and response["error"]["code"] == "request_timeout"

        kept = http.client.HTTPConnection(*address(s), timeout=30)
        kept.request("GET", "/health")
        kept.getresponse().read()
        assert closed_by_server(kept.sock)  # idle after its response: keep-alive ends it
    finally:
        s.stop()


def test_a_trickled_body_is_cut_by_the_request_deadline_and_its_connection_freed(tmp_path, qwen2):
    """Each byte comes well within the 30 s a read of the body may wait; the request as a whole does
    not come within its deadline. With every connection taken by such requests, they are cut, and
    the next request is served (the probe: 8 of them held --max-connections 8 for 100 s)."""
    s = Served(tmp_path / "chat.db", qwen2, max_connections=2, request_timeout_s=1).wait_ready()
    trickles = [socket.create_connection(address(s), timeout=20) for _ in range(2)]
    stop = threading.Event()

    def trickle():
        for _ in range(500):
            if stop.wait(0.1):
                return
            for sock in trickles:
                try:
                    sock.sendall(b" ")
                except OSError:
                    pass

    thread = threading.Thread(target=trickle)
    try:
        for sock in trickles:
            sock.sendall(
                b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
        thread.start()
        for sock in trickles:
            status, response = response_of(sock)
            assert status == 408 and response["error"]["code"] == "request_timeout"
            assert "within 1 s" in response["error"]["message"]
            assert closed_by_server(sock)
        wait_for(lambda: not s.server.server_state.connections)
        assert [m.id for m in s.client.models.list()] == [MODEL]
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        s.stop()


def test_a_body_sent_at_a_fair_rate_may_take_longer_than_the_deadline(tmp_path, qwen2):
    s = Served(tmp_path / "chat.db", qwen2, request_timeout_s=0.5, min_body_rate=1000).wait_ready()
    try:
        sock = socket.create_connection(address(s), timeout=20)
        body = json.dumps({"title": "slow but steady", "system_prompt": " " * 1000}).encode()
        sock.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 100):  # 1 s of body at 1,000 bytes a second: twice the deadline
            sock.sendall(body[i : i + 100])
            threading.Event().wait(0.1)
        status, response = response_of(sock)
        assert status == 201 and response["title"] == "slow but steady"
    finally:
        s.stop()


def test_a_client_leaving_mid_body_is_one_line_in_the_log(served, capfd):
    log = StderrLines()
    with contextlib.redirect_stderr(log):
        for path, kind in (
            ("/v1/chat/completions", "application/json"),
            ("/v1/sessions/import", "application/octet-stream"),
        ):
            sock = socket.create_connection(address(served), timeout=20)
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: 1000\r\n\r\n{{".encode())
            sock.close()
            wait_for(lambda path=path: log.said(f"POST {path} 499 "))
        assert served.ask("hi").choices[0].message.content is not None
        wait_for(lambda: log.said("POST /v1/chat/completions 200 "))  # a line comes once it is answered
    assert len(log.lines) == 3, log.lines  # and the request after
    assert "Traceback" not in "\n".join(log.lines) + capfd.readouterr().err


def test_past_max_connections_a_request_gets_503_and_its_connection_is_closed(tmp_path, qwen2):
    s = Served(
        tmp_path / "chat.db", qwen2, max_connections=2, keep_alive_s=60, header_timeout_s=60
    ).wait_ready()
    try:
        first, second, third = (http.client.HTTPConnection(*address(s), timeout=30) for _ in range(3))
        for conn in (first, second):
            conn.request("GET", "/v1/models")
            assert conn.getresponse().read()
        third.request("GET", "/v1/models")
        response = third.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 503 and error["code"] == "too_many_connections"
        assert response.headers["Retry-After"] == "1" and response.headers["Connection"] == "close"
        first.close()
        third.close()
        wait_for(lambda: len(s.server.server_state.connections) == 1)
        assert [m.id for m in s.client.models.list()] == [MODEL]  # room again
        second.close()
    finally:
        s.stop()


def test_serve_says_running_out_of_files_in_a_line_logs_each_request_and_stops_cleanly(tmp_path, qwen2):
    key = "s3cret-key-4242"
    cmd = [sys.executable, "-m", "llama_chat", "--db", str(tmp_path / "chat.db"), "--model", str(qwen2),
           "serve", "--port", "0"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "LLAMA_CHAT_API_KEY": key}
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    clients: list[socket.socket] = []
    try:
        wait_for(lambda: any("ready in" in line for line in lines), 120)
        base = lines[0].split("listening on ")[1].split()[0]
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 3, hard))
        host, port = base.removeprefix("http://").rsplit(":", 1)
        # the backlog holds them
        clients = [socket.create_connection((host, int(port)), timeout=30) for _ in range(30)]
        wait_for(lambda: any("cannot accept connections" in line for line in lines))
        # accept() fails again at each retry (every second), and is not said again
        threading.Event().wait(2.5)
        for c in clients:
            c.close()
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert [m.id for m in client.models.list()] == [MODEL]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    log = "".join(lines)
    assert "Traceback" not in log and key not in log
    said = [line for line in lines if "cannot accept connections" in line]
    assert 1 <= len(said) <= 2 and "Too many open files" in said[0] and "--max-connections" in said[0]
    assert (
        "llama-chat serve: POST /v1/chat/completions 200 " in log
        and "llama-chat serve: GET /v1/models 200 " in log
    )
    assert lines[-1].strip() == "llama-chat serve: stopped (SIGTERM)"


# -- the small refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("temperature", "Infinity"), ("temperature", "1e308"),
                                              ("temperature", "NaN"), ("repeat_penalty", "1e308"),
                                              ("top_p", "-Infinity")])
def test_sampling_numbers_a_sampler_cannot_use_are_400_naming_the_field(served, field, value):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}'
    status, error = error_of(served.raw("POST", "/v1/chat/completions", body.encode()))
    assert status == 400 and error["param"] == field


def test_an_import_is_refused_as_it_arrives_and_no_error_names_a_server_path(served):
    host, port = address(served)
    # a body announcing a gigabyte, of which only its first bytes are sent: refused on them
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(
        b"POST /v1/sessions/import HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/octet-stream\r\n"
        b"Content-Length: 1000000000\r\n\r\n" + b"this is not a session file, " * 4
    )
    status, body = response_of(sock)
    assert (
        status == 400
        and body["error"]["message"] == "Not a usable .llamachat file: not a llama-chat session file"
    )
    sock.close()
    # a real file's header, and more bytes after it than the header declares
    sid = json.loads(served.raw("POST", "/v1/sessions", b"{}")[2])["id"]
    served.ask("hello", extra_body={"session": sid}, max_tokens=2)
    data = served.raw("GET", f"/v1/sessions/{sid}/export")[2]
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(
        b"POST /v1/sessions/import HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/octet-stream\r\n"
        + f"Content-Length: {len(data) + 1000000}\r\n\r\n".encode()
        + data
        + b"\0" * 4096
    )
    assert response_of(sock)[0] == 413
    sock.close()

    for damaged in (data[:-10], data[:40], b"", data[:10] + b"x" * 100):
        status, error = error_of(upload(served, damaged))
        assert status == 400 and error["message"].startswith("Not a usable .llamachat file: ")
        assert "llama-chat-import" not in error["message"] and "/" not in error["message"]


def memory_mb(field: str) -> float:
    """This process's (and so the server's, which runs in it) VmRSS or VmHWM (its peak), in MB."""
    line = next(
        line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":")
    )
    return int(line.split()[1]) / 1024


def test_an_import_holds_a_piece_of_its_upload_in_memory_whatever_its_size(served, tmp_path):
    """300 MB with a valid header and damaged content, sent as it is made (the test holds 1 MB of
    it): refused with 400, the server's peak memory grown by less than 64 MB (it held the file twice,
    a 1 GB upload took it from 923 to 2,985 MB), and nothing left beside the database."""
    size, manifest_size = 300 << 20, 1000
    head = pack_header(manifest_size, size - HEADER_SIZE - manifest_size - 32)
    piece = bytes(1 << 20)

    def body():
        yield head
        sent = len(head)
        while sent < size:
            yield piece[: size - sent]
            sent += min(len(piece), size - sent)

    conn = http.client.HTTPConnection(*address(served), timeout=120)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = memory_mb("VmRSS")
    conn.request("POST", "/v1/sessions/import", body(), {"Content-Type": "application/octet-stream",
                                                          "Content-Length": str(size)})
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    grown = memory_mb("VmHWM") - before
    conn.close()
    assert response.status == 400 and error["message"].endswith(
        "checksum mismatch: the file is damaged or incomplete"
    )
    assert grown < 64, f"{grown:.0f} MB"
    assert [p.name for p in (tmp_path).iterdir() if "import" in p.name] == []


def test_imports_past_the_limit_at_once_get_429(served):
    uploads = []
    for _ in range(2):  # two imports under way: their headers came, the rest has not yet
        sock = socket.create_connection(address(served), timeout=20)
        sock.sendall(
            b"POST /v1/sessions/import HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
            b"application/octet-stream\r\n"
            b"Content-Length: 100000\r\n\r\n" + pack_header(1000, 50000)
        )
        uploads.append(sock)
    try:
        wait_for(lambda: served.state.imports == 2)
        status, error = error_of(upload(served, b"anything"))
        assert (
            status == 429
            and error["code"] == "rate_limit_exceeded"
            and error["message"].startswith("2 imports")
        )
    finally:
        for sock in uploads:
            sock.close()
    wait_for(lambda: served.state.imports == 0)
    assert error_of(upload(served, b"anything"))[0] == 400  # its turn: it is read, and refused


def test_an_unforeseen_failure_says_its_kind_to_the_client_and_the_rest_to_the_log(
    served, monkeypatch, capsys
):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", "/srv/secret/chat.db")

    monkeypatch.setattr(served.state.sessions.store, "list_sessions", full)
    status, error = error_of(served.raw("GET", "/v1/sessions"))
    assert status == 500 and error["message"] == "The server failed (OSError); its log says why."
    assert "/srv/secret/chat.db" in capsys.readouterr().err


def test_the_log_shows_what_a_client_sent_without_its_control_characters(served):
    log = StderrLines()
    with contextlib.redirect_stderr(log):
        # a title, a clear, a line
        status, _, _ = served.raw("GET", "/v1/%1b]0;owned%07%1b[2Jx%0aGET%20/forged")
        assert status == 404
        # the request's line is written once its answer is sent: the client may read the answer first
        wait_for(lambda: log.said("owned"))
    (line,) = [line for line in log.lines if "owned" in line]
    assert line.startswith("llama-chat serve: GET /v1/\\x1b]0;owned\\x07\\x1b[2Jx\\x0aGET /forged 404")


def test_what_is_cheap_to_refuse_is_refused_before_the_prompt_is_tokenized(served, monkeypatch):
    from llama_chat.app.chat import conversations

    prompts = []
    render = conversations.chat_prompt_ids
    monkeypatch.setattr(
        conversations, "chat_prompt_ids", lambda *a, **kw: prompts.append(1) or render(*a, **kw)
    )
    n_ctx = served.state.engine.n_ctx
    many = [{"role": "user", "content": "a"}] * n_ctx
    status, error = error_of(
        served.raw("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": many}).encode())
    )
    assert (
        status == 400
        and error["code"] == "context_length_exceeded"
        and f"{n_ctx:,} messages" in error["message"]
    )
    monkeypatch.setattr(served.scheduler, "max_queued", 0)  # the queue is full
    with pytest.raises(openai.RateLimitError):
        served.ask("hi")
    assert prompts == []
    monkeypatch.undo()
    assert served.ask("hi").choices[0].message.content is not None


def test_the_flags_reach_the_server_options(tmp_path, capsys):
    db = ["--db", str(tmp_path / "chat.db")]
    args = build_parser().parse_args([*db, "serve", "--allowed-host", "nas.lan", "--allowed-host", "nas",
                                      "--cors-origin", PAGE, "--max-connections", "9"])
    options, _ = options_from(args)
    assert (options.allowed_hosts, options.cors_origins, options.max_connections) == (
        ("nas.lan", "nas"),
        (PAGE,),
        9,
    )
    args = build_parser().parse_args(
        [*db, "--block-size", "16", "serve", "--kv-codec", "f16", "--ctx", "512", "--activations", "q8"]
    )
    engine = options_from(args)[0].engine  # what the server's chat engine is built from
    assert (engine.block_size, engine.codec, engine.n_ctx, engine.db) == (
        16,
        "f16",
        512,
        tmp_path / "chat.db",
    )
    assert engine.activations == "q8"
    served_by_default = options_from(build_parser().parse_args([*db, "serve"]))[0].engine
    assert served_by_default.activations == DEFAULT_ACTIVATIONS  # as chat and ask
    assert served_by_default.use_mmap
    assert not options_from(build_parser().parse_args([*db, "serve", "--no-mmap"]))[0].engine.use_mmap
    assert options_from(build_parser().parse_args([*db, "serve"]))[0].max_connections == MAX_CONNECTIONS
    assert (
        options_from(build_parser().parse_args([*db, "serve", "--drain-seconds", "5"]))[0].drain_seconds == 5
    )
    assert main([*db, "serve", "--max-connections", "0"]) == 2
    assert capsys.readouterr().err.strip() == "llama-chat: error: --max-connections must be 1 or more"


def test_log_lines_of_requests_at_once_are_never_cut_or_joined(capfd):
    """Each access line is written whole with its newline: lines of several requests finishing at once
    (threads) come out one per line, as a log reader (or a test reading the log as it grows) needs."""
    from llama_chat.app.serve.state import say

    def many(n: int) -> None:
        for i in range(400):
            say(f"POST /v1/chat/completions 200 {n}-{i} ms")

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often, as on a busy server
    try:
        threads = [threading.Thread(target=many, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 8 * 400 and all(line.startswith("llama-chat serve: POST ") for line in lines)
