"""The env client against the HTTP server stacks env servers run on, each started here: this
project's own (waitress), uvicorn (under AgentGym's servers), gunicorn's sync workers (`Connection:
close` on every answer) and gthread workers (2 s keep-alive), Python's http.server (HTTP/1.0) and
werkzeug's development server (`flask run`), then raw servers that send the body after the headers,
send it chunked, trickle it past the deadline, close in the middle of an answer, or drop a request
that comes on a connection they kept idle. Every stack serves Corridor (this project's app, or the
app behind a small adapter); each plays create, reset, steps and close; where the server fails, the
error's kind is asserted."""

import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import pytest
from conftest import ROOT

import env_client
from env_client import EnvClient, EnvError, EnvPool
from env_server.app import create_app, serve_in_thread
from env_server.corridor import CorridorEnv

TASK = 4  # Corridor's task 4: the goal is 4 cells to the right


def corridor_wsgi():
    """This project's Corridor app (gunicorn builds it from this name)."""
    return create_app(CorridorEnv)


def forward(app, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One request answered by the Flask app, for servers that send the answer their own way."""
    r = app.test_client().open(path, method=method, data=body,
                               content_type="application/json" if body else None)
    return r.status_code, r.get_data()


def play(url: str, timeout: float = 10.0) -> None:
    """A whole episode through EnvClient (each step reaches the game once), then a pool's round."""
    c = EnvClient(url, timeout=timeout)
    assert c.reset(TASK) == "The goal is 4 steps to your right."
    for left in (3, 2, 1):
        s = c.step("right")
        view = f"The goal is {left} step{'s' * (left > 1)} to your right."
        assert (s.observation, s.done) == (view, False)
    s = c.step("right")
    assert (s.observation, s.reward, s.done) == ("You reached the goal.", 1.0, True)
    assert c.detail()["position"] == 4
    c.close()
    with EnvPool(url, 3, timeout=timeout) as pool:
        assert pool.reset([TASK, TASK + 1, None])[:2] == ["The goal is 4 steps to your right.",
                                                          "The goal is 4 steps to your left."]
        out = pool.step(["right", "left", None])
        assert [s.observation for s in out[:2]] == ["The goal is 3 steps to your right.",
                                                    "The goal is 3 steps to your left."], out


def serve_thread(server) -> str:
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


# ---------------------------------------------------------------- real stacks
def test_waitress():
    url, stop = serve_in_thread(CorridorEnv)
    try:
        play(url)
    finally:
        stop()


def test_uvicorn():
    uvicorn = pytest.importorskip("uvicorn", reason="pip install -r requirements-test.txt")
    flask_app = corridor_wsgi()

    async def asgi(scope, receive, send):  # the protocol over ASGI, as AgentGym's FastAPI servers
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        query = scope["query_string"].decode()
        path = scope["path"] + ("?" + query) * bool(query)
        status, data = forward(flask_app, scope["method"], path, body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        while not server.started:
            assert thread.is_alive() and time.monotonic() - t0 < 10, "uvicorn did not start"
            time.sleep(0.01)
        play(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}")
    finally:
        server.should_exit = True
        thread.join(5)
        flask_app.extensions["registry"].stop()


@pytest.mark.parametrize("worker", ["sync", "gthread"])
def test_gunicorn(worker, tmp_path):
    """gunicorn's sync workers close the connection after every answer; its gthread workers keep it
    for 2 s: the client waits past that before its steps, which must neither fail nor go twice."""
    pytest.importorskip("gunicorn", reason="pip install -r requirements-test.txt")
    log = tmp_path / "gunicorn.log"
    cmd = [sys.executable, "-m", "gunicorn", "-k", worker, "-w", "1", "-b", "127.0.0.1:0",
           "--graceful-timeout", "1", "--chdir", ROOT, "--pythonpath", os.path.join(ROOT, "tests"),
           *(["--threads", "4"] if worker == "gthread" else []),  # (threads turn sync into gthread)
           "test_server_stacks:corridor_wsgi()"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while "Listening at: " not in log.read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 30, log.read_text()
            time.sleep(0.05)
        url = log.read_text().split("Listening at: ")[1].split()[0]
        c = EnvClient(url, timeout=10.0)
        c.reset(TASK)
        time.sleep(2.5 if worker == "gthread" else 0)  # its keep-alive ends meanwhile
        assert [c.step("right").done for _ in range(4)] == [False, False, False, True]
        assert c.detail()["position"] == 4
        play(url)
    finally:
        proc.send_signal(signal.SIGINT)  # quick shutdown
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


class ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


def test_http_server_http10():
    """Python's http.server, as wsgiref serves the app: HTTP/1.0, headers and body in separate
    writes, the connection closed after each answer."""
    server, app = ThreadingWSGIServer(("127.0.0.1", 0), Quiet), corridor_wsgi()
    server.set_app(app)
    play_then_stop(server, app)


def test_werkzeug_development_server():
    from werkzeug.serving import make_server

    app = corridor_wsgi()
    play_then_stop(make_server("127.0.0.1", 0, app, threaded=True), app)


def play_then_stop(server, app) -> None:
    """The client's game against a WSGI `server` serving `app`, then both stopped."""
    try:
        play(serve_thread(server))
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["registry"].stop()


# ---------------------------------------------------------------- raw servers
class RawHandler(BaseHTTPRequestHandler):
    """Answers the protocol (from the Flask app) in the way `server.mode` names: "late" (the body
    50 ms after the headers), "chunked", "trickle" (a step's answer a byte every 0.2 s), "cut" (a
    step's answer, and the first reset's, broken off halfway), "stale" (a request on a connection
    idle for over 1.2 s is dropped, as by a server that closes it just then)."""

    def log_message(self, *args):
        pass

    def answer(self):
        srv, n = self.server, int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n)
        now, idle = time.monotonic(), time.monotonic() - getattr(self, "last", time.monotonic())
        self.last = now
        if self.path == "/step":
            srv.steps += 1
        if srv.mode == "stale" and idle > 1.2:
            self.close_connection = True
            return
        status, data = forward(srv.app, self.command, self.path, body)
        head = f"{self.protocol_version} {status} X\r\nContent-Type: application/json\r\n"
        first_reset = self.path == "/reset" and not srv.resets
        cut = srv.mode == "cut" and (self.path == "/step" or first_reset)
        srv.resets += self.path == "/reset"
        if srv.mode == "chunked":
            self.wfile.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            for part in [p for p in (data[:5], data[5:9], data[9:]) if p] + [b""]:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                time.sleep(0.01)
            return
        self.wfile.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode())
        if srv.mode == "late":
            time.sleep(0.05)
        if cut:
            self.wfile.write(data[:len(data) // 2])
            self.close_connection = True
            return
        if srv.mode == "trickle" and self.path == "/step":
            for i in range(len(data)):
                try:
                    self.wfile.write(data[i:i + 1])
                except OSError:
                    return  # the client gave up
                time.sleep(0.2)
            return
        self.wfile.write(data)

    do_GET = do_POST = answer


@pytest.fixture
def raw_server():
    servers = []

    def start(mode: str, protocol: str = "HTTP/1.1"):
        handler = type("Handler", (RawHandler,), {"protocol_version": protocol})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.mode, server.app, server.steps, server.resets = mode, corridor_wsgi(), 0, 0
        servers.append(server)
        return serve_thread(server), server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
        server.app.extensions["registry"].stop()


@pytest.mark.parametrize("protocol", ["HTTP/1.0", "HTTP/1.1"])
def test_body_after_the_headers(raw_server, protocol):
    """The body 50 ms after the headers; the connection closed after each answer, or kept."""
    url, _ = raw_server("late", protocol)
    play(url)


def test_chunked_answers(raw_server):
    url, _ = raw_server("chunked")
    play(url)


@pytest.mark.parametrize("protocol", ["HTTP/1.0", "HTTP/1.1"])
def test_an_answer_trickled_past_the_deadline(raw_server, protocol):
    """A step's answer trickles a byte every 0.2 s (each read well within any per-read timeout): the
    step fails as a timeout at the 1 s deadline, sent once; the instance still closes. (An HTTP/1.0
    answer owns the socket once its headers are read: the deadline holds there too.) The deadline
    is the step's alone, so that a loaded machine's slow create or reset is no timeout; the bound,
    10 s, leaves it room, and is half the time the answer takes to trickle in."""
    url, server = raw_server("trickle", protocol)
    c = EnvClient(url, timeout=10.0)
    c.reset(TASK)
    c.http.timeout = 1.0
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        c.step("right")
    took = time.monotonic() - t0
    assert e.value.kind == "timeout" and "1 s" in e.value.message and took < 10, (e.value, took)
    assert server.steps == 1
    c.http.timeout = 10.0
    c.close()


def test_an_answer_cut_off_halfway(raw_server):
    """The first reset's answer breaks off: retried, it succeeds. A step's does: a connection error,
    and the step was sent once (the game moved once)."""
    url, server = raw_server("cut")
    c = EnvClient(url, timeout=5.0)
    assert c.reset(TASK) == "The goal is 4 steps to your right." and server.resets == 2
    with pytest.raises(EnvError) as e:
        c.step("right")
    assert e.value.kind == "connection" and server.steps == 1, e.value
    assert c.detail()["position"] == 1
    c.close()


def test_a_step_never_goes_out_on_a_connection_idle_too_long(raw_server, monkeypatch):
    """The server drops a request that comes on a connection it kept idle for over 1.2 s (the moment
    a server's keep-alive ends): after 1.5 s idle the client opens a fresh connection, so the step
    is played. Without the idle bound, the step goes out on the kept connection and fails, once."""
    url, server = raw_server("stale")
    c = EnvClient(url, timeout=5.0)
    c.reset(TASK)
    time.sleep(1.5)
    assert c.step("right").observation == "The goal is 3 steps to your right." and server.steps == 1
    monkeypatch.setattr(env_client, "MAX_IDLE_S", 60.0)
    c.step("right")
    time.sleep(1.5)
    with pytest.raises(EnvError) as e:
        c.step("right")
    assert e.value.kind == "connection" and server.steps == 3, e.value
    assert c.detail()["position"] == 2  # the dropped step never reached the game
