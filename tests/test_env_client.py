"""env_client.py: EnvClient and EnvPool against our server and against stand-ins that
answer the way AgentGym's own servers do (env_idx ids, bare-int create, score, terminated/truncated,
HTTP-200 error bodies)."""

import socket
import time

import pytest
from conftest import raw
from flask import Flask, jsonify, request
from toy_env import CounterEnv

from env_client import EnvClient, EnvError, EnvPool, Transport
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
    c = EnvClient(toy_server, timeout=0.3)
    c.reset(19)
    with pytest.raises(EnvError) as e:
        c.step("sleep 1.5")
    assert e.value.kind == "timeout"
    with pytest.raises(EnvError) as e:
        c.reset(500)
    assert e.value.kind == "http" and e.value.status == 400 and "out of range" in e.value.message


def test_retries_only_where_safe(toy_server, monkeypatch):
    """A dropped connection is retried for reset (repeating it changes nothing) but never for step."""
    c = EnvClient(Transport(toy_server, retries=2))
    c.reset(19)
    real_conn, calls = c.http._conn, {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] % 2 == 1:
            raise ConnectionResetError("dropped")
        return real_conn()

    monkeypatch.setattr(c.http, "_conn", flaky)
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
                              [None if s is None else (s.observation, s.reward, s.done) for s in s2])
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
    app, games, key = Flask("agentgym_like"), {}, ("env_idx" if dialect in ("webarena", "searchqa") else "id")

    @app.get("/")
    def hello():
        return jsonify(f"This is environment {dialect}.")

    @app.post("/create")
    def create():
        i = len(games)
        games[i] = {"task": None, "n": 0}
        if dialect == "searchqa":
            return jsonify(i)
        if dialect == "webarena":
            return jsonify({"env_idx": i})
        return jsonify({"id": i, "observation": "", "reward": 0, "done": False})

    @app.post("/reset")
    def reset():
        b = request.get_json()
        if b.get(key) not in games:
            return jsonify({"error": f"The id {b.get(key)} is not valid."})
        task = b["idx"] if dialect == "webarena" else b["data_idx"]
        games[b[key]] = {"task": task, "n": 0}
        if dialect == "webarena":
            return jsonify({"observation": "bare page"})  # the prompt comes from /observation
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
            return jsonify({"observation": obs, "reward": 1.0, "terminated": g["n"] >= 2, "truncated": False})
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
    assert w.step("click [1]").done is False and w.step("stop [x]").done is True  # from `terminated`
    q = EnvClient(agentgym_server("searchqa"))
    assert q.id_key == "env_idx" and q.reset(3) == "task 3"


def test_pool_falls_back_to_single_requests(agentgym_server):
    with EnvPool(agentgym_server("textcraft"), 3) as pool:
        assert pool.use_batch is False  # plain-text health: no batch endpoint
        assert pool.reset([1, 2, 3]) == ["task 1", "task 2", "task 3"]
        assert [s.observation for s in pool.step(["a", "b", None])[:2]] == ["a #1", "b #1"]
