"""env_client.py: EnvClient and EnvPool against our server and against stand-ins that
answer the way AgentGym's own servers do (env_idx ids, bare-int create, score, terminated/truncated,
HTTP-200 error bodies, uvicorn's 5 s keep-alive), a server that trickles its answer, and step
answers no reward may come from (NaN, a string for done)."""

import json
import math
import socket
import threading
import time

import pytest
import urllib3
from conftest import raw
from flask import Flask, Response, jsonify, request
from toy_env import CounterEnv

import env_client
from env_client import EnvClient, EnvError, EnvPool, Step, Transport, _step_from
from rollout import train_reward
from env_server.app import create_app, serve_wsgi_in_thread


# ---------------------------------------------------------------- our server
def test_client_full_episode(toy_server):
    c = EnvClient(toy_server)
    assert c.id_key == "id"
    assert c.reset(1) == "Reach 4."
    assert c.available_actions() == ["add N"] and c.expert_action() == "add 4"
    s = c.step("add 4")
    assert (s.observation, s.reward, s.done) == ("Total: 4", 1.0, True)
    assert c.observation() == "Total: 4" and c.detail()["done"] is True
    with pytest.raises(EnvError) as e:
        c.step("add 1")
    assert e.value.kind == "http" and e.value.status == 409
    c.close()
    c.close()  # idempotent on the client side


def test_client_errors_are_distinct(toy_server, make_toy_server):
    with pytest.raises(ValueError, match="bad env server address"):
        EnvClient("ftp://nowhere")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EnvError) as e:
        EnvClient(f"http://127.0.0.1:{port}", retries=1)
    assert e.value.kind == "connection"
    c = EnvClient(toy_server, timeout=30.0)
    assert c.http.timeout == 30.0  # each attempt's deadline
    c.reset(19)
    # a short deadline for the hung step alone: a create or a reset on a loaded machine may take
    # longer than 0.3 s, and the game's answer comes long after it
    c.http.timeout = 0.3
    with pytest.raises(EnvError) as e:
        c.step("sleep 5")
    assert e.value.kind == "timeout"
    c.http.timeout = 30.0
    with pytest.raises(EnvError) as e:
        c.reset(500)
    assert e.value.kind == "http" and e.value.status == 400 and "out of range" in e.value.message


def test_retries_only_where_safe(toy_server, monkeypatch):
    """A dropped connection is retried for reset (repeating it changes nothing) but never for
    step."""
    c = EnvClient(Transport(toy_server, retries=2))
    c.reset(19)
    real_urlopen, calls = c.http.pool.urlopen, {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] % 2 == 1:
            raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError())
        return real_urlopen(*args, **kw)

    monkeypatch.setattr(c.http.pool, "urlopen", flaky)
    assert c.reset(19) == "Reach 1000000."
    assert calls["n"] == 2
    with pytest.raises(EnvError) as e:
        c.step("add 1")
    assert e.value.kind == "connection" and calls["n"] == 3  # one attempt only
    monkeypatch.undo()
    assert c.detail()["total"] == 0  # the failed step never reached the game


def test_a_retried_create_makes_one_instance():
    """The server made the instance but its answer came too late (the client timed out and retried):
    the retry carries the same request_key and gets that instance, not a second one."""
    app = create_app(CounterEnv, first_id=0)
    creates = []

    def late_first_answer(environ, start_response):
        out = app(environ, start_response)  # the app has handled it: the instance exists
        if environ["PATH_INFO"] == "/create":
            creates.append(1)
            if len(creates) == 1:
                time.sleep(1.0)  # the answer leaves after the client gave up on it
        return out

    url, stop = serve_wsgi_in_thread(late_first_answer)
    try:
        c = EnvClient(Transport(url, timeout=0.5, retries=2))
        assert len(creates) == 2 and c.id == 0
        assert raw(url, "GET", "/")[1]["instances"] == 1
        assert c.reset(0) == "Reach 3."
        assert EnvClient(Transport(url)).id == 1  # another client: its own key, its own instance
    finally:
        stop()
        app.extensions["registry"].stop()


def test_pool_batch_and_single_agree(toy_server):
    ids = list(range(10))
    results = {}
    for batch in (True, False):
        with EnvPool(toy_server, 10, use_batch=batch, workers=4) as pool:
            assert pool.use_batch is batch
            first = pool.reset(ids)
            s1 = pool.step(["add 3"] * 10)
            s2 = pool.step([None if s.done else "add 100" for s in s1])
            results[batch] = (first, [(s.observation, s.reward, s.done) for s in s1],
                              [None if s is None else (s.observation, s.reward, s.done)
                               for s in s2])
    assert results[True] == results[False]
    assert results[True][1][0] == ("Total: 3", 1.0, True)
    assert results[True][2][0] is None and results[True][2][1] == ("Total: 103", 0.0, True)


def test_pool_autodetects_batch_and_isolates_errors(toy_server):
    with EnvPool(toy_server, 4) as pool:
        assert pool.use_batch
        pool.reset([0, 0, 19, None])
        out = pool.step(["add 3", "crash", "add 1", None])
        assert out[0].done and isinstance(out[1], EnvError) and out[1].status == 500
        assert out[2].observation == "Total: 1" and out[3] is None
        out = pool.step(["add 1", None, None, "add 1"])  # 0 is done, 3 was never reset
        assert isinstance(out[0], EnvError) and out[0].status == 409
        assert isinstance(out[3], EnvError) and out[3].status == 409


# ---------------------------------------------------------------- AgentGym-style servers
def agentgym_like(dialect: str) -> Flask:
    """A stand-in answering as AgentGym's servers do for `dialect`: errors as HTTP 200 bodies,
    a plain-text health answer, and the dialect's id key and step fields."""
    app, games, key = (Flask("agentgym_like"), {},
                       ("env_idx" if dialect in ("webarena", "searchqa") else "id"))

    @app.get("/")
    def hello():
        return jsonify(f"This is environment {dialect}.")

    @app.post("/create")
    def create():
        i = len(games)
        # {"id": <task>} is required (FastAPI's 422 without it); a bare id back
        if dialect == "searchqa":
            b = request.get_json(silent=True) or {}
            if not isinstance(b.get("id"), int):
                return jsonify({"detail": "field required: id"}), 422
            games[i] = {"task": b["id"], "n": 0}
            return jsonify(i)
        games[i] = {"task": None, "n": 0}
        if dialect == "webarena":
            return jsonify({"env_idx": i})
        return jsonify({"id": i, "observation": "", "reward": 0, "done": False})

    @app.post("/reset")
    def reset():
        b = request.get_json()
        if b.get(key) not in games:
            return jsonify({"error": f"The id {b.get(key)} is not valid."})
        task = b[{"webarena": "idx", "searchqa": "id"}.get(dialect, "data_idx")]
        games[b[key]] = {"task": task, "n": 0}
        if dialect == "webarena":
            return jsonify({"observation": "bare page"})  # the prompt comes from /observation
        if dialect == "searchqa":
            return jsonify(f"task {task}")  # the observation itself
        return jsonify({key: b[key], "observation": f"task {task}", "reward": 0, "done": False})

    @app.post("/step")
    def step():
        b = request.get_json()
        if b.get(key) not in games:
            return jsonify({"error": f"The id {b.get(key)} is not valid."})
        g = games[b[key]]
        g["n"] += 1
        obs = f"{b['action']} #{g['n']}"
        if dialect == "webarena":
            return jsonify({"observation": obs, "reward": 1.0, "terminated": g["n"] >= 2,
                            "truncated": False})
        if dialect == "babyai":
            return jsonify({"observation": obs, "reward": 0.0, "score": 0.75, "done": True})
        return jsonify({"observation": obs, "reward": 0.0, "done": False})

    @app.get("/observation")
    def observation():
        i = int(request.args[key])
        return jsonify(f"task {games[i]['task']}")

    @app.post("/close")
    def close():
        return jsonify(True)

    return app


@pytest.fixture
def agentgym_server():
    stops = []

    def start(dialect):
        url, stop = serve_wsgi_in_thread(agentgym_like(dialect))
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


def test_drives_agentgym_textcraft_dialect(agentgym_server):
    c = EnvClient(agentgym_server("textcraft"))
    assert c.id_key == "id" and c.reset(7) == "task 7"
    assert c.step("get 1 stick").observation == "get 1 stick #1"
    c.id = 99  # an id the server does not know: AgentGym answers HTTP 200 with an error body
    with pytest.raises(EnvError) as e:
        c.step("inventory")
    assert e.value.kind == "env" and "not valid" in e.value.message


def test_drives_agentgym_babyai_score(agentgym_server):
    c = EnvClient(agentgym_server("babyai"))
    c.reset(0)
    s = c.step("turn left")
    assert s.reward == 0.75 and s.raw["reward"] == 0.0 and s.done  # the score is what counts


def test_drives_agentgym_webarena_and_searchqa_dialects(agentgym_server):
    w = EnvClient(agentgym_server("webarena"))
    assert w.id_key == "env_idx" and w.reset(12) == "task 12"  # observation fetched after reset
    # from `terminated`
    assert w.step("click [1]").done is False and w.step("stop [x]").done is True
    q = EnvClient(agentgym_server("searchqa"))
    assert q.id_key == "env_idx" and q.observation() == "task 0"  # created on task `id` 0
    assert (q.reset(3) == "task 3"
            and q.step("<search>x</search>").observation == "<search>x</search> #1")
    q.close()


def test_pool_falls_back_to_single_requests(agentgym_server):
    with EnvPool(agentgym_server("textcraft"), 3) as pool:
        assert pool.use_batch is False  # plain-text health: no batch endpoint
        assert pool.reset([1, 2, 3]) == ["task 1", "task 2", "task 3"]
        assert [s.observation for s in pool.step(["a", "b", None])[:2]] == ["a #1", "b #1"]


# -------------------------------------------------------------- uvicorn: idle connections it closes
def counting_asgi_app():
    """Just enough of the protocol for a pool, as a bare ASGI app (AgentGym's servers are FastAPI on
    uvicorn): a plain-text health answer (so no /batch), /create, /reset, /step; `app.steps` counts
    the /step calls that reached it."""

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg.get("body", b""), msg.get("more_body", False)
        path = scope["path"]
        if path == "/create":
            app.made += 1
            out = {"id": app.made}
        elif path == "/step":
            app.steps += 1
            out = {"observation": f"step {app.steps}", "reward": 0.0, "done": False}
        elif path == "/reset":
            out = {"observation": "start", "reward": 0, "done": False}
        else:  # "/", "/close"
            out = "This is environment counting."
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(out).encode()})

    app.made = app.steps = 0
    return app


@pytest.fixture
def uvicorn_server():
    """A factory: start counting_asgi_app() on a real uvicorn in a thread; returns (url, app, the
    uvicorn.Server)."""
    uvicorn = pytest.importorskip(
        "uvicorn", reason="uvicorn is not installed (pip install -r requirements-test.txt)")
    running = []

    def start(**config):
        app = counting_asgi_app()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                               lifespan="off", **config))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        t0 = time.monotonic()
        while not server.started:
            assert thread.is_alive() and time.monotonic() - t0 < 10, "uvicorn did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", app, server

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(5)


def test_steps_after_idle_on_uvicorn_default_keep_alive(uvicorn_server):
    """uvicorn closes a connection idle for 5 s (its timeout_keep_alive default); a step must not
    go out on one it closed, and is never sent twice: 4 steps, 4 answers, 4 steps seen by the
    server."""
    url, app, _ = uvicorn_server()
    with EnvPool(url, 4) as pool:
        assert pool.use_batch is False
        assert pool.reset([0, 1, 2, 3]) == ["start"] * 4
        time.sleep(6)
        out = pool.step(["go"] * 4)
        assert all(isinstance(s, Step) for s in out), out
        assert app.steps == 4


def test_a_connection_the_server_closed_is_never_reused(uvicorn_server, monkeypatch):
    """With the idle bound out of the way, the pool's probe alone must see that uvicorn (keep-alive
    1 s) closed each kept connection, and open a fresh one: every step succeeds, each sent once."""
    monkeypatch.setattr(env_client, "MAX_IDLE_S", 60.0)
    url, app, server = uvicorn_server(timeout_keep_alive=1)
    with EnvPool(url, 4) as pool:
        pool.reset([0, 1, 2, 3])
        time.sleep(1.5)
        # until uvicorn has closed them all (a loaded machine may run its 1 s timer late): a step
        # sent while it closes one would fail however good the probe
        deadline = time.monotonic() + 30
        while server.server_state.connections:
            assert time.monotonic() < deadline, "uvicorn kept its idle connections open"
            time.sleep(0.05)
        out = pool.step(["go"] * 4)
        assert all(isinstance(s, Step) for s in out), out
        assert app.steps == 4


# ---------------------------------------------------------------- a server that trickles its answer
@pytest.fixture
def trickler():
    """A raw HTTP server on loopback that reads each request, then sends an answer one byte every
    0.3 s that never ends (a header line without end). Connections after the first `trickled` get
    a prompt answer. Each trickle stops when the client hangs up, or after 30 s, so that a client
    without a total deadline fails the test (its bound: 10 s) rather than hanging it. Yields (url,
    start(trickled), connections)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stopping, seen, trickled = threading.Event(), [], [1]

    def serve(conn, n):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            if n >= trickled[0]:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 12\r\n\r\n"
                             b'{"ok": true}')
                return
            answer, t0 = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 100_000, time.monotonic()
            for byte in answer:
                if stopping.is_set() or time.monotonic() - t0 > 30:
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return  # the client hung up
                time.sleep(0.3)

    def accept():
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            seen.append(conn)
            threading.Thread(target=serve, args=(conn, len(seen) - 1), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def start(n: int) -> None:
        trickled[0] = n

    yield f"http://127.0.0.1:{listener.getsockname()[1]}", start, seen
    stopping.set()
    listener.close()


def test_a_trickling_answer_is_cut_off_at_the_deadline(trickler):
    """The timeout bounds the whole call, not each read: a byte every 0.3 s never lets a 1 s
    per-read timeout fire, yet the call ends as a timeout after about 1 s (bound: 10 s, for a
    loaded machine; without the deadline it would last the trickle's 30 s), and the connection is
    dropped (the next call opens another, which answers)."""
    url, _, seen = trickler
    t = Transport(url, timeout=1.0, retries=0)
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        t.request("POST", "/step", {"id": 0, "action": "go"})
    took = time.monotonic() - t0
    assert e.value.kind == "timeout" and "1 s" in e.value.message and took < 10, (e.value, took)
    assert len(seen) == 1 and t.request("GET", "/observation?id=0") == {"ok": True}
    assert len(seen) == 2


def test_each_retry_of_a_read_gets_its_own_deadline(trickler):
    """A read-only call is retried after a timeout; the retry starts a deadline of its own (were the
    first attempt's deadline shared, the retry would have no time left), and the first attempt
    ends at its own (the bound, 10 s, is the trickle's 30 s less a loaded machine's margin)."""
    url, _, seen = trickler
    t0 = time.monotonic()
    assert (Transport(url, timeout=1.0, retries=1).request("GET", "/observation?id=0", retry=True)
            == {"ok": True})
    assert len(seen) == 2 and time.monotonic() - t0 < 10


# ---------------------------------------------------------------- step answers that are no reward
@pytest.mark.parametrize("raw,field", [
    ({"observation": "o", "reward": math.nan, "done": True}, "reward"),
    ({"observation": "o", "reward": math.inf, "done": True}, "reward"),
    ({"observation": "o", "reward": -math.inf, "done": True}, "reward"),
    ({"observation": "o", "reward": "1.0", "done": True}, "reward"),
    ({"observation": "o", "reward": True, "done": True}, "reward"),
    # json.loads reads it; float() cannot
    ({"observation": "o", "reward": 10 ** 400, "done": True}, "reward"),
    ({"observation": "o", "reward": 0.0, "score": math.nan, "done": True}, "score"),
    ({"observation": "o", "reward": math.nan, "score": 0.5, "done": True}, "reward"),
    ({"observation": "o", "reward": 1.0, "done": "false"}, "done"),
    ({"observation": "o", "reward": 1.0, "done": 2}, "done"),
    ({"observation": "o", "reward": 1.0, "done": None}, "done"),
    ({"observation": "o", "reward": math.nan, "terminated": True, "truncated": False}, "reward"),
    # finite, but infinite as the trainer's float32 (it used to end the run in algos._finite)
    ({"observation": "o", "reward": 1e39, "done": True}, "reward"),
    ({"observation": "o", "reward": 0.0, "score": 1e308, "done": True}, "score"),
    ({"observation": "o", "reward": -10 ** 39, "done": False}, "reward"),
    ({"observation": "o", "reward": 1.0, "terminated": "true", "truncated": False}, "terminated"),
    ({"observation": "o", "reward": 1.0, "terminated": False, "truncated": "no"}, "truncated"),
])
def test_step_values_no_reward_may_come_from(raw, field):
    """NaN and ±Infinity (which json.loads accepts), strings, bools as rewards, and a done that is
    not a bool (bool("false") is True) are protocol errors naming the field, never a reward."""
    with pytest.raises(EnvError) as e:
        _step_from(raw)
    assert e.value.kind == "protocol" and f"{field}=" in e.value.message, e.value


def test_valid_step_answers_still_parse():
    # ints for done: some servers
    s = _step_from(json.loads('{"observation": "o", "reward": 1, "done": 1}'))
    assert (s.reward, s.done) == (1.0, True) and isinstance(s.reward, float)
    big = _step_from({"observation": "o", "reward": 3.4e38, "done": True})  # float32's range
    assert big.reward == 3.4e38
    assert _step_from({"observation": "o", "reward": 0.5, "done": 0}).done is False
    babyai = _step_from({"observation": "o", "reward": 0.0, "score": 0.75, "done": True})
    sciworld = _step_from({"observation": "o", "reward": 3, "score": 35, "done": False, "info": {}})
    # the server's scale
    assert (babyai.reward, sciworld.reward, sciworld.done) == (0.75, 35.0, False)
    assert (train_reward("babyai", babyai.reward),
            train_reward("sciworld", sciworld.reward)) == (0.75, 0.35)
    webarena = _step_from({"observation": "o", "reward": 1.0, "terminated": True,
                           "truncated": False})
    assert (webarena.reward, webarena.done) == (1.0, True)
    cut = _step_from({"observation": "o", "reward": 1.0, "terminated": 0, "truncated": 1})
    assert (cut.reward, cut.done) == (0.0, True)


@pytest.mark.parametrize("raw", [{"observation": "o", "done": True},
                                 {"observation": "o", "reward": 1.0},
                                 {"observation": "o", "terminated": True, "truncated": False},
                                 {"observation": "o"}])
def test_a_step_answer_without_a_reward_or_a_done_flag_is_malformed(raw):
    """Neither score nor reward, or none of done, terminated, truncated: a protocol error, never a
    reward of 0 or an episode still running."""
    with pytest.raises(EnvError) as e:
        _step_from(raw)
    assert e.value.kind == "protocol" and "without a reward or done" in e.value.message


@pytest.mark.parametrize("batch", [False, True])
def test_pool_turns_a_nan_reward_into_that_instances_error(batch):
    """A server answering NaN for instance id 1 (as raw JSON: json.loads reads NaN) costs that
    instance only, by single requests and by /batch alike."""
    app, made = Flask("nan_reward"), []

    def step_answer(i):
        return '{"observation": "o", "reward": %s, "done": false}' % ("NaN" if i == 1 else "0.5")

    @app.get("/")
    def health():
        return jsonify({"batch": batch})

    @app.post("/create")
    def create():
        made.append(len(made))
        return jsonify({"id": made[-1]})

    @app.post("/reset")
    def reset():
        return jsonify({"observation": "start", "reward": 0, "done": False})

    @app.post("/step")
    def step():
        return Response(step_answer(request.get_json()["id"]), mimetype="application/json")

    @app.post("/batch")
    def batch_ops():
        ops = request.get_json()["ops"]
        results = [step_answer(op["id"]) if op["op"] == "step" else '"start"' for op in ops]
        return Response('{"results": [%s]}' % ", ".join(results), mimetype="application/json")

    url, stop = serve_wsgi_in_thread(app)
    try:
        with EnvPool(url, 3) as pool:
            assert pool.use_batch is batch
            pool.reset([0, 1, 2])
            out = pool.step(["go"] * 3)
            # instances are created in parallel, in any order
            bad = [c.id for c in pool.clients].index(1)
        assert (isinstance(out[bad], EnvError) and out[bad].kind == "protocol"
                and "reward=nan" in out[bad].message)
        assert [s.reward for i, s in enumerate(out) if i != bad] == [0.5, 0.5]
    finally:
        stop()


def test_an_answer_past_the_cap_is_an_env_error_and_the_flag_sets_the_cap(toy_server, capsys,
                                                                          monkeypatch):
    """CounterEnv echoes a malformed action in its observation: a 90 KB action, a 90 KB answer.
    The default cap (4 MB) takes it; a 50 KB cap makes it that instance's error (a pool's other
    instances play on), and --env-max-answer-mb sets the cap of the clients made after."""
    import train

    monkeypatch.setattr(env_client, "MAX_ANSWER_BYTES", env_client.MAX_ANSWER_BYTES)  # restored
    long = "x" * 90_000
    c = EnvClient(toy_server)
    c.reset(0)
    assert long in c.step(long).observation
    with EnvPool(toy_server, 2, use_batch=False, max_answer_bytes=50_000) as pool:
        pool.reset([0, 1])
        out = pool.step([long, "add 1"])
    assert isinstance(out[0], EnvError) and out[0].kind == "protocol", out[0]
    assert "answer over 50000 bytes" in out[0].message and out[1].observation == "Total: 1"
    with EnvPool(toy_server, 2, use_batch=True, max_answer_bytes=50_000) as pool:
        pool.reset([0, 1])  # /batch: 50 KB an op, 100 KB for the two
        assert all(isinstance(s, EnvError) and "answer over 100000 bytes" in s.message
                   for s in pool.step([long, long]))
    train.parse_args(["--env", "corridor", "--env-max-answer-mb", "0.05"])
    c = EnvClient(toy_server)
    c.reset(0)
    with pytest.raises(EnvError, match=f"answer over {int(0.05 * 2**20)} bytes"):
        c.step(long)
    with pytest.raises(SystemExit):
        train.parse_args(["--env", "corridor", "--env-max-answer-mb", "0"])
    assert "--env-max-answer-mb must be positive, got 0" in capsys.readouterr().err


def test_a_pool_past_the_servers_room_is_refused_before_any_instance_is_made(tmp_path):
    """--batch-size 100000 once made the pool ask for 800,000 instances one by one, silent for
    minutes: now one answer names the room (the server's --max-instances less what it holds), and
    train.py says it in one line."""
    import subprocess
    import sys

    from conftest import ROOT

    url, stop = serve_wsgi_in_thread(create_app(CounterEnv, None, max_instances=4))
    try:
        with EnvPool(url, 1):
            with pytest.raises(EnvError, match=r"a pool of 4 instances .* has room for 3 \(its "
                                               r"--max-instances 4\)"):
                EnvPool(url, 4)
            assert raw(url, "GET", "/")[1]["instances"] == 1
    finally:
        stop()
    out = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--batch-size", "200",
                          "--steps", "1", "--out", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "train.py: a pool of 1600 instances (--batch-size x --group-size) does not fit")
    assert not (tmp_path / "run").exists()
