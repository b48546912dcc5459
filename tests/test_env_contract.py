"""Contract tests of the real environments served by `python -m env_server NAME`, over real HTTP, in
a separate process: every endpoint, the bad-input cases, determinism across processes, experts
solving tasks through the client, and 64 parallel clients with zero errors."""

import os
import subprocess
import sys
import threading

import pytest
from conftest import ROOT, play_expert, raw

from env_client import EnvClient, EnvError, EnvPool
from env_server.app import ServerProcess

ENVS = ["textcraft", "babyai", "searchqa"]
TURN_BUDGET = {"textcraft": 30, "babyai": 64, "searchqa": 5}


@pytest.fixture(scope="module", params=ENVS)
def server(request):
    with ServerProcess(request.param) as s:
        s.name = request.param
        yield s


def test_every_endpoint(server):
    url = server.url
    status, h = raw(url, "GET", "/")
    assert status == 200 and h["env"] == server.name and h["num_tasks"] > 0
    status, t = raw(url, "GET", "/tasks")
    assert set(t["splits"]) >= {"train", "test"} and t["splits"]["test"]
    status, c = raw(url, "POST", "/create", {})
    assert status == 200 and isinstance(c["id"], int)
    iid, task = c["id"], t["splits"]["test"][0]
    status, d = raw(url, "GET", f"/detail?id={iid}")  # asked before the first reset too
    assert status == 200 and d["task"] is None and d["task_id"] is None
    status, r = raw(url, "POST", "/reset", {"id": iid, "data_idx": task})
    assert status == 200 and r["observation"] and r["done"] is False
    status, obs = raw(url, "GET", f"/observation?id={iid}")
    assert status == 200 and isinstance(obs, str) and obs
    status, acts = raw(url, "GET", f"/available_actions?id={iid}")
    assert status == 200 and isinstance(acts, list)
    status, d = raw(url, "GET", f"/detail?id={iid}")
    assert status == 200 and d["task"] == task and d["done"] is False
    status, s = raw(url, "POST", "/step", {"id": iid, "action": "dance wildly"})
    # a bad action is a game event, not an error
    assert status == 200 and isinstance(s["observation"], str)
    assert s["done"] is False and s["reward"] == 0
    status, a = raw(url, "GET", f"/expert_action?id={iid}")
    assert status == 200 and isinstance(a, str) and a
    status, s = raw(url, "POST", "/step", {"id": iid, "action": a})
    assert status == 200 and set(s) >= {"observation", "reward", "score", "done"}
    assert raw(url, "POST", "/close", {"id": iid}) == (200, True)


def test_bad_input(server):
    url, n = server.url, raw(server.url, "GET", "/")[1]["num_tasks"]
    iid = raw(url, "POST", "/create", {})[1]["id"]
    cases = [
        ("POST", "/reset", {"id": iid, "data_idx": n}, 400),
        ("POST", "/reset", {"id": iid, "data_idx": -1}, 400),
        ("POST", "/step", {"id": iid, "action": "x"}, 409),  # no task yet
        ("POST", "/step", b"{oops", 400),
        ("POST", "/step", {"id": iid}, 400),
        ("POST", "/step", {"id": str(iid), "action": "x"}, 400),
        ("POST", "/step", {"id": 10**12, "action": "x"}, 404),
        ("GET", "/observation?id=nope", None, 400),
        ("POST", "/step", {"id": iid, "action": "x" * (2 << 20)}, 413),
    ]
    for method, path, body, status in cases:
        got, out = raw(url, method, path, body)
        assert got == status and "error" in out, (
            path, body if not isinstance(body, dict) else list(body), out)
    raw(url, "POST", "/close", {"id": iid})
    got, out = raw(url, "POST", "/reset", {"id": iid, "data_idx": 0})
    assert got == 404 and "closed" in out["error"]
    assert raw(url, "GET", "/")[0] == 200


def test_step_after_done_is_409(server):
    c = EnvClient(server.url)
    value, _ = play_expert(c, raw(server.url, "GET", "/tasks")[1]["splits"]["test"][0],
                           TURN_BUDGET[server.name])
    assert value > 0
    with pytest.raises(EnvError) as e:
        c.step("inventory")
    assert e.value.status == 409
    c.close()


@pytest.mark.parametrize("name", ENVS)
def test_same_tasks_in_every_process(name):
    """Task ids mean the same game in two processes with different hash seeds."""
    snapshots = []
    for seed in ("1", "987654"):
        with ServerProcess(name, env={**os.environ, "PYTHONHASHSEED": seed}) as s:
            n = raw(s.url, "GET", "/")[1]["num_tasks"]
            c = EnvClient(s.url)
            snapshots.append([(c.reset(i), c.detail(), c.expert_action())
                              for i in (0, 1, 7, n // 2, n - 1)])
    assert snapshots[0] == snapshots[1]


def test_experts_solve_test_tasks_through_the_client(server):
    tasks = raw(server.url, "GET", "/tasks")[1]["splits"]["test"][:12]
    c = EnvClient(server.url)
    results = [play_expert(c, t, TURN_BUDGET[server.name]) for t in tasks]
    solved = [v > 0 for v, _ in results]
    assert sum(solved) >= len(tasks) - 1, results  # BabyAI's expert may miss a rare layout
    c.close()


def test_64_parallel_clients_zero_errors(server):
    train = raw(server.url, "GET", "/tasks")[1]["splits"]["train"]
    errors, values = [], []

    def worker(k):
        try:
            c = EnvClient(server.url)
            values.append(play_expert(c, train[k % len(train)], TURN_BUDGET[server.name])[0])
            c.close()
        except Exception as e:  # any failure, not only EnvError, fails the test below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(values) == 64
    assert sum(v > 0 for v in values) >= 60


def test_pool_batch_plays_the_same_game_as_single_requests(server):
    tasks = raw(server.url, "GET", "/tasks")[1]["splits"]["test"][:8]
    transcripts = []
    for batch in (True, False):
        with EnvPool(server.url, len(tasks), use_batch=batch) as pool:
            first = pool.reset(tasks)
            actions = [c.expert_action() for c in pool.clients]
            transcripts.append((first, [(s.observation, s.reward, s.done)
                                        for s in pool.step(actions)]))
    assert transcripts[0] == transcripts[1]


def test_cli_errors_name_the_flag():
    run = [sys.executable, "-m", "env_server"]
    out = subprocess.run(run + ["textcraft", "--threads", "0"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "--threads" in out.stderr and "0 is outside" in out.stderr
    out = subprocess.run(run + ["nosuchenv"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'nosuchenv'" in out.stderr
    out = subprocess.run(run + ["textcraft", "--recipes", "/no/such/dir"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "/no/such/dir" in out.stderr


def test_corridor_test_games_are_not_training_games():
    """Held-out Corridor tasks are other games (distance 3) than any training task (1, 2, 4)."""
    from env_server.corridor import CorridorEnv

    env, splits = CorridorEnv(None), CorridorEnv.splits(None)

    def game(i):
        env.reset(i)
        return env.goal

    assert not {game(i) for i in splits["test"]} & {game(i) for i in splits["train"]}
    assert ({abs(game(i)) for i in splits["test"]} == {3}
            and {abs(game(i)) for i in splits["train"]} == {1, 2, 4})


def test_corridor_says_one_step_not_one_steps():
    from env_server.corridor import CorridorEnv

    env = CorridorEnv(None)
    assert env.reset(0) == "The goal is 1 step to your right."
    assert env.reset(1) == "The goal is 1 step to your left."
    assert env.reset(2) == "The goal is 2 steps to your right."
    assert env.step("right").observation == "The goal is 1 step to your right."
