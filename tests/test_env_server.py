"""The generic server (env_server/app.py) on a toy game: protocol shapes, every bad-input case,
locking, the instance cap, the reaper, batch calls, and that a bug in a game is a 500 that kills
nothing."""

import contextlib
import threading
import time

import pytest
from conftest import raw
from toy_env import CounterEnv

from env_server.app import create_app, serve_in_thread, serve_wsgi_in_thread
from env_server.base import StepResult, TaskError


def test_health_and_tasks(toy_server):
    status, h = raw(toy_server, "GET", "/")
    assert status == 200 and h["status"] == "ok" and h["env"] == "counter" and h["batch"] is True
    assert h["num_tasks"] == 20
    status, t = raw(toy_server, "GET", "/tasks")
    assert status == 200 and t["num_tasks"] == 20 and t["splits"]["test"] == [15, 16, 17, 18, 19]


def test_agentgym_shapes_full_episode(toy_server):
    status, c = raw(toy_server, "POST", "/create", {})
    assert status == 200 and set(c) >= {"id", "observation", "reward", "done"} and c["id"] == 0
    status, r = raw(toy_server, "POST", "/reset", {"id": 0, "data_idx": 2})
    assert status == 200 and r == {"id": 0, "observation": "Reach 5.", "reward": 0, "score": 0,
                                   "done": False}
    assert raw(toy_server, "GET", "/observation?id=0") == (200, "Total: 0")
    assert raw(toy_server, "GET", "/available_actions?id=0") == (200, ["add N"])
    assert raw(toy_server, "GET", "/expert_action?id=0") == (200, "add 5")
    status, s = raw(toy_server, "POST", "/step", {"id": 0, "action": "add 2"})
    assert (status == 200 and s["observation"] == "Total: 2" and s["done"] is False
            and s["reward"] == 0)
    status, s = raw(toy_server, "POST", "/step", {"id": 0, "action": "add 3"})
    assert (s["done"] is True and s["reward"] == 1.0 and s["score"] == 1.0
            and s["info"] == {"turns": 2})
    status, d = raw(toy_server, "GET", "/detail?id=0")
    assert d == {"target": 5, "total": 5, "task": 2, "done": True}
    assert raw(toy_server, "POST", "/close", {"id": 0}) == (200, True)


def test_create_with_task_and_env_idx_alias(toy_server):
    status, c = raw(toy_server, "POST", "/create", {"data_idx": 3})
    assert status == 200 and c["observation"] == "Reach 6."
    # AgentGym's SearchQA/WebArena dialect: env_idx and idx
    status, r = raw(toy_server, "POST", "/reset", {"env_idx": c["id"], "idx": 4, "seed": 0})
    assert status == 200 and r["observation"] == "Reach 7."
    assert raw(toy_server, "GET", f"/observation?env_idx={c['id']}") == (200, "Total: 0")
    # `env_idx` names the instance, so an `id` beside it is a task, never another instance
    status, r = raw(toy_server, "POST", "/reset", {"env_idx": c["id"], "id": 1})
    assert status == 200 and r["id"] == c["id"] and r["observation"] == "Reach 4."
    status, r = raw(toy_server, "POST", "/step", {"env_idx": c["id"], "id": 99, "action": "add 1"})
    assert status == 200 and r["observation"] == "Total: 1"


class BareCounterEnv(CounterEnv):
    bare_answers = True


def test_bare_answers_speak_agentgym_searchqa_dialect():
    url, stop = serve_in_thread(BareCounterEnv, first_id=0)
    try:
        # a bare id; the instance is on task 3
        assert raw(url, "POST", "/create", {"id": 3}) == (200, 0)
        assert raw(url, "GET", "/observation?env_idx=0") == (200, "Total: 0")
        assert raw(url, "GET", "/detail?env_idx=0")[1]["task"] == 3
        assert raw(url, "POST", "/create", None, {}) == (200, 1)  # no body: a bare id, no task yet
        # the bare observation
        assert raw(url, "POST", "/reset", {"env_idx": 1, "id": 2}) == (200, "Reach 5.")
        status, s = raw(url, "POST", "/step", {"env_idx": 1, "action": "add 5"})
        assert (status == 200 and s["done"] is True
                and set(s) >= {"observation", "reward", "done", "info"})
        assert raw(url, "POST", "/close", {"env_idx": 1}) == (200, True)
        # the project's own shapes on the same server: a create without `id`, a reset by `id`,
        # /batch
        status, c = raw(url, "POST", "/create", {"request_key": "k"})
        assert status == 200 and c["id"] == 2 and c["observation"] == ""
        status, r = raw(url, "POST", "/reset", {"id": 2, "data_idx": 1})
        assert status == 200 and r["observation"] == "Reach 4."
        ops = [{"op": "create", "id": 4}, {"op": "reset", "env_idx": 2, "id": 0}]
        status, out = raw(url, "POST", "/batch", {"ops": ops})
        assert (status == 200 and out["results"][0]["observation"] == "Reach 7."
                and out["results"][1]["id"] == 2)
        # mistakes are 4xx JSON errors in this dialect too
        for path, body, code in [("/create", {"id": "0"}, 400), ("/create", {"id": 20}, 400),
                                 ("/create", {"id": True}, 400), ("/reset", {"env_idx": 2}, 400),
                                 ("/reset", {"env_idx": 2, "id": -1}, 400),
                                 ("/reset", {"env_idx": "2", "id": 0}, 400),
                                 ("/reset", {"env_idx": 99, "id": 0}, 404),
                                 ("/step", {"env_idx": 2}, 400), ("/close", {"env_idx": None}, 400),
                                 ("/close", {"env_idx": 1}, 404)]:
            status, e = raw(url, "POST", path, body)
            assert status == code and "error" in e, (path, body, status, e)
    finally:
        stop()


@pytest.mark.parametrize("method,path,body,status,needle", [
    ("POST", "/step", b"{not json", 400, "not valid JSON"),
    ("POST", "/step", b"\xff\xfe", 400, "not valid JSON"),
    ("POST", "/step", [1, 2], 400, "must be a JSON object"),
    ("POST", "/step", {"action": "add 1"}, 400, "missing field 'id'"),
    ("POST", "/step", {"id": "0", "action": "add 1"}, 400, "'id' must be an integer"),
    ("POST", "/step", {"id": True, "action": "add 1"}, 400, "'id' must be an integer"),
    ("POST", "/step", {"id": 0.5, "action": "add 1"}, 400, "'id' must be an integer"),
    ("POST", "/step", {"id": 0}, 400, "missing field 'action'"),
    ("POST", "/step", {"id": 0, "action": 7}, 400, "'action' must be a string"),
    ("POST", "/step", {"id": 0, "action": None}, 400, "'action' must be a string"),
    ("POST", "/step", {"id": 99, "action": "add 1"}, 404, "unknown instance id 99"),
    ("POST", "/step", {"id": -1, "action": "add 1"}, 404, "unknown instance id -1"),
    ("POST", "/step", {"id": 10**30, "action": "add 1"}, 404, "unknown instance id"),
    ("POST", "/reset", {"id": 0}, 400, "missing field 'data_idx'"),
    ("POST", "/reset", {"id": 0, "data_idx": 20}, 400, "out of range"),
    ("POST", "/reset", {"id": 0, "data_idx": -1}, 400, "out of range"),
    ("POST", "/reset", {"id": 0, "data_idx": "3"}, 400, "'data_idx' must be an integer"),
    ("POST", "/create", {"data_idx": 10**9}, 400, "out of range"),
    ("POST", "/close", {}, 400, "missing field 'id'"),
    ("GET", "/observation", None, 400, "missing query parameter 'id'"),
    ("GET", "/observation?id=abc", None, 400, "must be an integer"),
    ("GET", "/detail?id=42", None, 404, "unknown instance id 42"),
    ("GET", "/no_such_endpoint", None, 404, "Not Found"),
    ("GET", "/step", None, 405, "Method Not Allowed"),
    ("POST", "/batch", {"ops": "step"}, 400, "'ops' must be a list"),
    ("POST", "/create", {"request_key": 7}, 400, "'request_key' must be a string"),
    ("POST", "/create", {"request_key": "k" * 201}, 400, "'request_key' is longer than 200"),
])
def test_bad_input_is_a_json_4xx(toy_server, method, path, body, status, needle):
    raw(toy_server, "POST", "/create", {"data_idx": 0})  # instance 0 exists
    got_status, got = raw(toy_server, method, path, body)
    assert got_status == status, got
    assert isinstance(got, dict) and needle in got["error"], got
    assert raw(toy_server, "GET", "/")[0] == 200  # still serving


def test_create_with_a_request_key_is_idempotent(toy_server):
    """A client that retries a create whose answer it lost sends the same key: one instance, not
    two."""
    def create(body):
        status, c = raw(toy_server, "POST", "/create", body)
        assert status == 200, c
        return c["id"]

    def live():
        return raw(toy_server, "GET", "/")[1]["instances"]

    a = create({"request_key": "k1"})
    assert create({"request_key": "k1"}) == a and live() == 1
    b = create({"request_key": "k2", "data_idx": 1})
    assert b != a and live() == 2
    assert create({}) not in (a, b) and live() == 3  # no key: a new instance every time
    status, out = raw(toy_server, "POST", "/batch", {"ops": [
        {"op": "create", "request_key": "k1"}, {"op": "create", "request_key": "k3"},
        {"op": "create", "request_key": "k3"}, {"op": "create", "request_key": None}]})
    r = out["results"]
    assert r[0]["id"] == a and r[1]["id"] == r[2]["id"] not in (a, b) and r[3]["status"] == 400
    assert live() == 4
    raw(toy_server, "POST", "/close", {"id": a})  # a key lives as long as its instance
    assert create({"request_key": "k1"}) not in (a, b) and live() == 4


def until(cond, what: str, timeout: float = 60.0) -> None:
    """Poll cond() until it holds; fail naming `what` after `timeout` s (a generous deadline: what
    a loaded machine delays is waited for, not raced)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.01)


def test_a_key_retried_while_its_create_is_running_waits_for_it():
    """A retry that arrives while the first create is still making its env gets that instance. The
    env (a JVM or a browser starting) is finished only once both retries wait for it (counted
    where the registry waits), so a loaded machine cannot let the first create end before they
    come."""
    building, finish = threading.Event(), threading.Event()

    class SlowToBuild(CounterEnv):
        def __init__(self, world):
            building.set()
            finish.wait(60)
            super().__init__(world)

    app = create_app(SlowToBuild, first_id=0)
    reg, waits = app.extensions["registry"], []
    real_wait = reg.waiting

    @contextlib.contextmanager
    def counted_wait():
        waits.append(1)
        with real_wait():
            yield

    reg.waiting = counted_wait
    url, stop = serve_wsgi_in_thread(app)
    try:
        ids = []
        threads = [threading.Thread(target=lambda: ids.append(raw(url, "POST", "/create",
                                                                  {"request_key": "k"})))
                   for _ in range(3)]
        threads[0].start()
        until(building.is_set, "the first create did not start making its env")
        for t in threads[1:]:
            t.start()
        until(lambda: len(waits) == 2, "the retries did not wait for the first create")
        finish.set()
        for t in threads:
            t.join(60)
        assert [s for s, _ in ids] == [200] * 3 and {c["id"] for _, c in ids} == {0}
        assert raw(url, "GET", "/")[1]["instances"] == 1
        assert raw(url, "POST", "/reset", {"id": 0, "data_idx": 0})[0] == 200
    finally:
        finish.set()
        stop()
        reg.stop()


def test_a_create_whose_reset_fails_leaves_no_instance():
    """A create with a task whose reset fails (task 18) answers the error and closes the instance
    it made: nobody knows its id. An instance an earlier create made, and a retry with its
    request_key resets, stays."""

    class FailingReset(CounterEnv):
        def reset(self, idx):
            if idx == 18:
                raise TaskError("no room for this game", 503)
            return super().reset(idx)

    url, stop = serve_in_thread(FailingReset, first_id=0, max_instances=1)
    try:
        for body in ({"data_idx": 18}, {"data_idx": 18}, {"data_idx": 18, "request_key": "k"}):
            status, e = raw(url, "POST", "/create", body)
            assert status == 503 and e["error"] == "no room for this game", e
        status, c = raw(url, "POST", "/create", {"data_idx": 0, "request_key": "k"})
        assert status == 200
        assert raw(url, "POST", "/create", {"data_idx": 18, "request_key": "k"})[0] == 503
        assert raw(url, "POST", "/create", {"request_key": "k"})[1]["id"] == c["id"]
    finally:
        stop()


def test_episode_state_errors(toy_server):
    raw(toy_server, "POST", "/create", {})
    status, e = raw(toy_server, "POST", "/step", {"id": 0, "action": "add 1"})
    assert status == 409 and "call /reset first" in e["error"]
    raw(toy_server, "POST", "/reset", {"id": 0, "data_idx": 0})
    raw(toy_server, "POST", "/step", {"id": 0, "action": "add 3"})
    status, e = raw(toy_server, "POST", "/step", {"id": 0, "action": "add 1"})
    assert status == 409 and "episode of instance 0 is over" in e["error"]
    # a reset revives it
    assert raw(toy_server, "POST", "/reset", {"id": 0, "data_idx": 0})[0] == 200
    assert raw(toy_server, "POST", "/close", {"id": 0})[0] == 200
    for method, path, body in [("POST", "/step", {"id": 0, "action": "add 1"}),
                               ("POST", "/close", {"id": 0}), ("GET", "/observation?id=0", None)]:
        status, e = raw(toy_server, method, path, body)
        assert status == 404 and "instance 0 is closed" in e["error"]


def test_oversized_body_is_413(make_toy_server):
    url = make_toy_server(max_body_bytes=1000)
    raw(url, "POST", "/create", {"data_idx": 0})
    status, e = raw(url, "POST", "/step", {"id": 0, "action": "x" * 5000})
    assert status == 413 and "error" in e
    assert raw(url, "POST", "/step", {"id": 0, "action": "add 1"})[0] == 200


def test_game_errors_and_bugs(toy_server):
    raw(toy_server, "POST", "/create", {"data_idx": 19})
    status, e = raw(toy_server, "POST", "/step", {"id": 0, "action": "refuse"})
    assert status == 422 and e["error"] == "the game refuses this"
    status, e = raw(toy_server, "POST", "/step", {"id": 0, "action": "crash"})
    assert status == 500 and "RuntimeError: a bug in the game" in e["error"]
    assert raw(toy_server, "POST", "/step", {"id": 0, "action": "add 1"})[0] == 200  # still serving


def test_instance_cap_is_a_clear_503(make_toy_server):
    url = make_toy_server(max_instances=3)
    for _ in range(3):
        assert raw(url, "POST", "/create", {})[0] == 200
    status, e = raw(url, "POST", "/create", {})
    assert (status == 503 and "server full: 3 live instances" in e["error"]
            and "--max-instances" in e["error"])
    raw(url, "POST", "/close", {"id": 1})
    status, c = raw(url, "POST", "/create", {})
    assert status == 200 and c["id"] == 3  # ids are never reused


def test_idle_instances_are_reaped():
    """An instance idle past --idle-timeout (0.3 s) is reaped; one inside a call is busy, not idle,
    however long ago the call began. The busy one is held inside one call (a reset that waits for
    the test), not kept busy by a loop of short steps, whose pauses a loaded machine could stretch
    past the timeout."""
    inside, release = threading.Event(), threading.Event()

    class Held(CounterEnv):
        def reset(self, idx):
            if idx == 19:
                inside.set()
                release.wait(60)
            return super().reset(idx)

    app = create_app(Held, first_id=0, idle_timeout_s=0.3)
    reg = app.extensions["registry"]
    url, stop = serve_wsgi_in_thread(app)
    try:
        raw(url, "POST", "/create", {"data_idx": 0})  # id 0: left idle
        held = []  # id 1: made, then inside its reset until released
        caller = threading.Thread(target=lambda: held.append(raw(url, "POST", "/create",
                                                                 {"data_idx": 19})))
        caller.start()
        until(inside.is_set, "the held call did not start")
        until(lambda: raw(url, "GET", "/")[1]["reaped"] == 1, "the idle instance was not reaped")
        time.sleep(0.4)  # the held call began more than the timeout ago: idle by the clock alone
        assert reg.reap() == 0  # a reaper pass skips it: it is busy
        status, e = raw(url, "POST", "/step", {"id": 0, "action": "add 1"})
        assert status == 404 and "reaped" in e["error"]
        health = raw(url, "GET", "/")[1]
        assert health["instances"] == 1 and health["reaped"] == 1
        release.set()
        caller.join(60)
        assert held[0][0] == 200 and held[0][1]["id"] == 1
    finally:
        release.set()
        stop()
        reg.stop()


def test_per_instance_lock_serialises_calls(toy_server):
    raw(toy_server, "POST", "/create", {"data_idx": 19})
    n_threads, per_thread = 8, 10

    def hammer():
        for _ in range(per_thread):
            assert raw(toy_server, "POST", "/step", {"id": 0, "action": "slowadd"})[0] == 200

    threads = [threading.Thread(target=hammer) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each slowadd reads, sleeps and writes: any interleaving would lose increments
    assert raw(toy_server, "GET", "/detail?id=0")[1]["total"] == n_threads * per_thread


def test_batch_mixes_ops_and_isolates_failures(toy_server):
    status, out = raw(toy_server, "POST", "/batch", {"ops": [
        {"op": "create", "data_idx": 0}, {"op": "create"}, {"op": "reset", "id": 1, "data_idx": 1},
        {"op": "step", "id": 0, "action": "add 3"}, {"op": "step", "id": 7, "action": "add 1"},
        {"op": "step", "id": 0, "action": "add 1"}, {"op": "explode"}, 5,
        {"op": "step", "id": 1, "action": "crash"},
        {"op": "close", "id": 1},
    ]})
    assert status == 200
    r = out["results"]
    assert (r[0]["observation"] == "Reach 3." and r[1]["id"] == 1
            and r[2]["observation"] == "Reach 4.")
    assert r[3]["done"] is True and r[3]["reward"] == 1.0
    assert r[4]["status"] == 404 and r[4]["error"].startswith("unknown instance id 7")
    assert r[5]["status"] == 409
    assert r[6]["status"] == 400 and r[7]["status"] == 400
    assert r[8]["status"] == 500 and "a bug in the game" in r[8]["error"]
    assert r[9] is True


def test_batch_plays_each_instance_s_ops_in_order_and_instances_side_by_side():
    """A game that plays batches on many threads (SearchQA, SciWorld) still plays one instance's
    ops in the batch's order, while other instances' ops run beside them: instance 1 waits, inside
    a step, for a step of instance 2 listed after it."""
    signal = threading.Event()

    class Threaded(CounterEnv):
        batch_threads = 8

        def step(self, action):
            if action == "wait":
                return StepResult(f"signalled: {signal.wait(30)}", 0.0, False)
            if action == "signal":
                signal.set()
            time.sleep(0.01)  # long enough for the batch's threads to queue for the instance
            return super().step(action)

    url, stop = serve_in_thread(Threaded, first_id=0)
    try:
        for _ in range(3):
            raw(url, "POST", "/create", {"data_idx": 19})  # endless
        ops = [{"op": "step", "id": 0, "action": f"add {k}"} for k in range(1, 25)]
        ops += [{"op": "step", "id": 1, "action": "wait"},
                {"op": "step", "id": 2, "action": "signal"}]
        status, out = raw(url, "POST", "/batch", {"ops": ops})
        assert status == 200
        assert [r["observation"] for r in out["results"][:24]] == [
            f"Total: {k * (k + 1) // 2}" for k in range(1, 25)]
        assert out["results"][24]["observation"] == "signalled: True"
    finally:
        signal.set()
        stop()


def test_batch_size_limit(make_toy_server):
    url = make_toy_server(max_batch_ops=4)
    status, e = raw(url, "POST", "/batch", {"ops": [{"op": "create"}] * 5})
    assert status == 400 and "at most 4 ops" in e["error"]


@pytest.mark.parametrize("argv,needle", [
    (["--port", "99999"], "argument --port: 99999 is outside [0, 65535]"),  # once: a random port
    (["--port", "-5"], "argument --port: -5 is outside [0, 65535]"),  # once: a 28-line traceback
    (["--port", "x"], "argument --port: not an integer: 'x'"),
    (["--threads", str(2 ** 64)], f"argument --threads: {2 ** 64} is outside [1, 1024]"),
    (["--op-timeout", "inf"], "argument --op-timeout: inf is outside"),
    (["--idle-timeout", "nan"], "argument --idle-timeout: nan is outside"),
    (["--parent-pid", "-1"], "argument --parent-pid: -1 is outside"),
])
def test_server_flags_out_of_range_are_one_line_and_exit_2(argv, needle, capsys):
    from env_server.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["corridor", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"python -m env_server: error: {needle}"), err


def test_idle_connections_at_the_limit_do_not_lock_new_clients_out():
    """Connections that never send a request are closed after channel_timeout (30 s by default,
    checked every cleanup_interval), so that a client holding the whole connection limit idle
    locks others out for that long at most (waitress's own 300 s before). Here the same rule at a
    small scale: 16 idle connections, the limit, 1 s."""
    import socket
    import urllib.request

    from env_server.app import create_app, make_server

    default = make_server(create_app(CounterEnv))
    assert (default.adj.channel_timeout, default.adj.cleanup_interval) == (30, 5)
    default.close()
    server = make_server(create_app(CounterEnv), connection_limit=16, channel_timeout=1,
                         cleanup_interval=1)
    threading.Thread(target=server.run, daemon=True).start()
    port = server.effective_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 20  # the idle ones reaped, not waited out for minutes
    finally:
        for s in idle:
            s.close()
        server.close()
