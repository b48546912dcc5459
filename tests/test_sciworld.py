"""SciWorld environment (env_server/sciworld.py): the game list and splits (no JVM needed), then the
real server over HTTP (`python -m env_server sciworld`, one JVM per instance): endpoints, bad input,
the expert, score (0-100 from the server, as AgentGym's; 0-1 where the rollout reads it) and episode
ends, the JVM cap, and a killed JVM. JVMs are slow to start (~2 s), so one server, capped at two
JVMs, serves the whole file and one shared instance plays the games."""

import argparse
import importlib.util
import os
import shutil
import signal
import time

import pytest
from conftest import raw

from env_server.agents import react_reply
from env_client import EnvClient, EnvError, EnvPool
from env_server import TaskError, get_env_class
from env_server.app import ServerProcess
from env_server.sciworld import EXCLUDED_TYPES, SciWorldEnv
from rollout import Reply, RolloutConfig, rollout

MAX_JVMS = 2  # the shared instance's and one more
MISSING = ("the scienceworld package is not installed"
           if importlib.util.find_spec("scienceworld") is None
           else "java is not on PATH" if shutil.which("java") is None else None)
needs_jvm = pytest.mark.skipif(MISSING is not None, reason=f"ScienceWorld cannot run: {MISSING}")


@pytest.fixture(scope="module")
def world():
    return SciWorldEnv.load_world()


@pytest.fixture(scope="module")
def server():
    with ServerProcess("sciworld", "--max-jvms", str(MAX_JVMS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """The instance that plays the games: its JVM lives from the first test that uses it to the
    end."""
    c = EnvClient(server.url)
    c.reset(0)
    yield c
    c.close()


def first_test_id(world, task_type: str) -> int:
    return next(i for i in world.splits["test"] if world.games[i][0] == task_type)


def play_expert(client: EnvClient, task: int) -> tuple[float, int]:
    """Play task with the expert through the HTTP client; return (final score, steps)."""
    client.reset(task)
    for steps in range(1, 101):
        action = client.expert_action()
        assert action is not None, (task, steps, client.detail())
        step = client.step(action)
        if step.done:
            return step.reward, steps
    return step.reward, steps


# ---- the game list: no JVM needed ----
def test_game_list_as_upstream(world):
    assert get_env_class("sciworld") is SciWorldEnv
    assert SciWorldEnv.num_tasks(world) == len(world.games) == 4639
    assert len(world.codes) == 23 and not set(world.codes.values()) & set(EXCLUDED_TYPES)
    # The package's order (1-1 ... 8-2), every variation in turn: the ids upstream's list gives.
    assert (world.games[0] == ("boil", 0) and world.games[29] == ("boil", 29)
            and world.games[30] == ("melt", 0))
    assert world.games[-1] == ("identify-life-stages-2", 9)
    assert world.games[-11] == ("identify-life-stages-1", 13)
    assert SciWorldEnv.task_category(world, 30) == "melt"
    assert SciWorldEnv.load_world() == world


def test_splits_are_the_package_variation_splits(world):
    splits = SciWorldEnv.splits(world)
    assert {k: len(v) for k, v in splits.items()} == {"train": 2312, "dev": 1156, "test": 1171}
    assert sorted(sum(splits.values(), [])) == list(range(4639))
    boil_test = [world.games[i] for i in splits["test"] if world.games[i][0] == "boil"]
    # the package's test variations of boil
    assert boil_test == [("boil", v) for v in range(21, 30)]


def test_jvm_flags():
    assert SciWorldEnv.load_world(argparse.Namespace(max_jvms=3, jvm_heap_mb=256)).max_jvms == 3
    # default: what fits in this machine's memory
    assert 1 <= SciWorldEnv.load_world().max_jvms <= 128
    for bad in ({"max_jvms": 0, "jvm_heap_mb": 512}, {"max_jvms": None, "jvm_heap_mb": 16}):
        with pytest.raises(ValueError, match="--max-jvms must be at least 1"):
            SciWorldEnv.load_world(argparse.Namespace(**bad))


# ---- one in-process instance: the shipped table against the package, the JVM's life ----
@needs_jvm
def test_shipped_table_matches_the_package_and_close_stops_the_jvm(world, monkeypatch):
    # restored afterwards: the JVM start sets it
    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    env = SciWorldEnv(world)
    assert env.detail()["jvm_pid"] is None  # no JVM before the first reset
    alive = SciWorldEnv._jvms_alive
    try:
        env.reset(0)
        sw, pid = env._sw, env.detail()["jvm_pid"]
        assert SciWorldEnv._jvms_alive == alive + 1
        with open(f"/proc/{pid}/environ", "rb") as f:
            options = [v for v in f.read().split(b"\0") if v.startswith(b"JAVA_TOOL_OPTIONS=")]
        assert options and options[0].endswith(f"-Xmx{world.jvm_heap_mb}m".encode())
        kept = [(code, name) for code, name in sw.tasks.items() if code not in EXCLUDED_TYPES]
        assert list(world.codes.items()) == [(name, code) for code, name in kept]
        split_of = {i: split for split, ids in world.splits.items() for i in ids}
        for _, name in kept:
            sw.load(name, 0, "")
            ids = [i for i, g in enumerate(world.games) if g[0] == name]
            assert len(ids) == sw.get_max_variations(name), name
            for split, variations in (("train", sw.get_variations_train()),
                                      ("dev", sw.get_variations_dev()),
                                      ("test", sw.get_variations_test())):
                assert ([world.games[i][1] for i in ids if split_of[i] == split]
                        == list(variations)), name
    finally:
        env.close()
    assert SciWorldEnv._jvms_alive == alive
    assert sw._gateway.java_process.poll() is not None  # the JVM has exited


@needs_jvm
def test_a_jvm_that_comes_up_after_its_instance_closed_is_stopped(world, monkeypatch):
    """A reset past the deadline is abandoned, and its instance closed, while its JVM may still be
    starting: that JVM is stopped once up, and its slot given back."""
    import scienceworld

    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    env, started = SciWorldEnv(world), []

    def start_while_closed(*args, **kw):
        started.append(real(*args, **kw))
        env.abandon()  # what the server does with a hung instance, here before the JVM is up
        return started[-1]

    real = scienceworld.ScienceWorldEnv
    monkeypatch.setattr(scienceworld, "ScienceWorldEnv", start_while_closed)
    alive = SciWorldEnv._jvms_alive
    try:
        with pytest.raises(TaskError, match="closed"):
            env.reset(0)
    finally:
        env.close()
    assert SciWorldEnv._jvms_alive == alive
    assert started[0]._gateway.java_process.poll() is not None  # the JVM has exited


# ---- the server ----
@needs_jvm
def test_every_endpoint(server, world):
    url = server.url
    status, h = raw(url, "GET", "/")
    assert status == 200 and h["env"] == "sciworld" and h["num_tasks"] == 4639
    assert raw(url, "GET", "/tasks")[1]["splits"] == SciWorldEnv.splits(world)
    iid = raw(url, "POST", "/create", {})[1]["id"]
    try:
        task = first_test_id(world, "find-living-thing")
        status, r = raw(url, "POST", "/reset", {"id": iid, "data_idx": task})
        assert status == 200 and (r["reward"], r["score"]) == (0, 0)
        assert r["done"] is False and r["deleted"] is False
        assert (r["task_name"], r["var_num"]) == world.games[task]  # upstream's answer, key for key
        description, look = r["task_description"], r["observation"]  # apart, as upstream sends them
        assert description.startswith("Your task is to find a(n) living thing.")
        # "look around", played by reset as upstream
        assert look.startswith("This room is called the ")
        assert raw(url, "GET", f"/observation?id={iid}") == (200, look)
        status, actions = raw(url, "GET", f"/available_actions?id={iid}")
        assert status == 200 and {"look around", "focus on OBJ", "move OBJ to OBJ"} <= set(actions)
        status, d = raw(url, "GET", f"/detail?id={iid}")
        assert status == 200 and d["task"] == task and d["task_description"] == description
        assert ((d["task_type"], d["task_number"], d["variation"])
                == ("find-living-thing", "4-1", world.games[task][1]))
        assert ((d["score"], d["steps"], d["moves"], d["done"], d["completed"])
                == (0, 0, 0, False, False))
        status, s = raw(url, "POST", "/step", {"id": iid, "action": "dance wildly"})
        assert status == 200 and s["observation"] == "No known action matches that input."
        assert (s["reward"], s["score"], s["done"]) == (0, 0, False)
        status, a = raw(url, "GET", f"/expert_action?id={iid}")
        # an unknown command did not leave the gold path
        assert status == 200 and isinstance(a, str) and a
        status, s = raw(url, "POST", "/step", {"id": iid, "action": a})
        assert status == 200 and set(s["info"]) == {"moves", "completed"}
        assert raw(url, "GET", f"/detail?id={iid}")[1]["steps"] == 2
    finally:
        assert raw(url, "POST", "/close", {"id": iid}) == (200, True)


@needs_jvm
def test_bad_input(server):
    url = server.url
    iid = raw(url, "POST", "/create", {})[1]["id"]
    cases = [
        ("POST", "/reset", {"id": iid, "data_idx": 4639}, 400),
        ("POST", "/reset", {"id": iid, "data_idx": -1}, 400),
        ("POST", "/reset", {"id": iid, "data_idx": "3"}, 400),
        ("POST", "/step", {"id": iid, "action": "look around"}, 409),  # no task yet
        ("POST", "/step", {"id": iid, "action": 5}, 400),
        ("GET", f"/observation?id={iid}", None, 409),
        ("GET", f"/available_actions?id={iid}", None, 409),
        ("GET", f"/expert_action?id={iid}", None, 409),
    ]
    for method, path, body, status in cases:
        got, out = raw(url, method, path, body)
        assert got == status and "error" in out, (path, body, out)
    assert raw(url, "GET", f"/detail?id={iid}")[1]["jvm_pid"] is None  # bad input started no JVM
    raw(url, "POST", "/close", {"id": iid})


@needs_jvm
def test_reset_reuses_the_jvm(client, world):
    pid = client.detail()["jvm_pid"]
    client.reset(first_test_id(world, "boil"))
    assert client.detail()["jvm_pid"] == pid


@needs_jvm
@pytest.mark.parametrize("task_type", ["find-living-thing", "power-component", "chemistry-mix",
                                       "lifespan-longest-lived"])
def test_expert_solves_a_test_task(client, world, task_type):
    score, _ = play_expert(client, first_test_id(world, task_type))
    d = client.detail()
    assert score == 100 and d["completed"] and d["score"] == 100, d
    assert client.expert_action() is None


@needs_jvm
def test_expert_after_free_actions_and_after_leaving_the_path(client, world):
    client.reset(first_test_id(world, "find-plant"))
    first = client.expert_action()
    # take no simulated time: still on the path
    for free in ("inventory", "look around", "fly away"):
        assert client.step(free).raw["info"]["moves"] == 0
        assert client.expert_action() == first
    client.step(first)
    second = client.expert_action()
    assert second not in (None, first)
    client.step("look at agent")  # takes a move, and is not the gold action
    assert client.detail()["moves"] == 2 and client.expert_action() is None


@needs_jvm
def test_expert_asked_mid_episode_replays_the_episode(client, world):
    # its gold path starts the same way in every load
    task = first_test_id(world, "use-thermometer")
    client.reset(task)
    first = client.expert_action()
    client.step(first)
    second = client.expert_action()
    client.reset(task)  # a new episode: no gold path until the expert is asked
    client.step(first)
    assert client.expert_action() == second  # generated now, with the episode replayed on it
    assert client.detail()["moves"] == 1 and client.step(second).raw["info"]["moves"] == 2
    client.reset(task)
    client.step("look at agent")  # off any gold path
    assert client.expert_action() is None and client.detail()["moves"] == 1


@needs_jvm
def test_negative_score_ends_the_episode(client, world):
    client.reset(first_test_id(world, "find-living-thing"))
    step = client.step("focus on agent")  # the wrong thing to focus on: the game fails the task
    assert (step.done and step.reward == -100
            and (step.raw["score"], step.raw["reward"]) == (-100, -100))
    with pytest.raises(EnvError) as e:
        client.step("look around")
    assert e.value.status == 409


class ExpertReplies:
    """A text policy that answers each instance's expert action in the prompt's format, and keeps
    the reward each trajectory holds when asked (the reward after the turn before)."""

    def __init__(self, pool):
        self.pool, self.seen = pool, []

    def replies(self, trajs, slots):
        self.seen.append([t.reward for t in trajs])
        actions = [self.pool.clients[i].expert_action() for i in slots]
        return [Reply(react_reply("sciworld", a)) if a else None for a in actions]


class RecordingPool:
    """An EnvPool that keeps every step's answer, as the server sent it."""

    def __init__(self, pool):
        self.pool, self.size, self.steps = pool, pool.size, []

    def reset(self, item_ids):
        return self.pool.reset(item_ids)

    def step(self, actions):
        out = self.pool.step(actions)
        self.steps.append(out[0])
        return out


@needs_jvm
def test_server_scores_0_to_100_and_the_rollout_reads_0_to_1(server, client, world):
    """The server's `score` is AgentGym's 0-100 integer and `reward` its change; the client's Step
    keeps the server's value; the trajectory's reward (what train.py and eval.py read) is that
    score / 100."""
    task = first_test_id(world, "find-living-thing")
    with EnvPool(server.url, 1) as pool:  # its instance takes the JVM the shared one leaves
        rec, policy = RecordingPool(pool), ExpertReplies(pool)
        done, = rollout(policy, rec, "sciworld", [task], [0], RolloutConfig(max_turns=30))
        description = pool.clients[0].detail()["task_description"]
    first = done.messages[2]["content"]  # the policy's first view: the task once, then the room
    assert first.startswith(description + "\nThis room is ") and first.count(description) == 1
    scores = [s.raw["score"] for s in rec.steps]
    assert all(type(v) is int for v in scores) and scores[-1] == 100, scores
    assert any(0 < v < 100 for v in scores), scores  # sub-goal credit along the way
    assert [s.raw["reward"] for s in rec.steps] == [b - a for a, b in zip([0] + scores, scores)]
    assert [s.reward for s in rec.steps] == scores  # the client's Step: the server's scale
    # the trainer's: 0-1
    assert [seen for seen, in policy.seen[1:]] == [v / 100 for v in scores[:-1]]
    assert done.status == "done" and done.reward == 1.0


@needs_jvm
def test_episode_ends_after_100_steps(client, world):
    client.reset(first_test_id(world, "boil"))
    for _ in range(99):
        assert not client.step("look around").done  # free: no simulated time passes
    step = client.step("look around")
    assert step.done and step.reward == 0 and client.detail()["steps"] == 100


@needs_jvm
def test_killed_jvm_fails_its_instance_only(server, client, world):
    url = server.url
    iid = raw(url, "POST", "/create", {})[1]["id"]
    task = first_test_id(world, "find-animal")
    try:
        assert raw(url, "POST", "/reset", {"id": iid, "data_idx": task})[0] == 200
        pid = raw(url, "GET", f"/detail?id={iid}")[1]["jvm_pid"]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"java" in f.read()
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):  # until it is a zombie, or already reaped by its parent (the server)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        status, out = raw(url, "POST", "/step", {"id": iid, "action": "look around"})
        assert status == 503 and f"JVM (pid {pid})" in out["error"] and "reset" in out["error"]
        status, out = raw(url, "POST", "/step", {"id": iid, "action": "look around"})
        assert status == 503 and "died" in out["error"]
        assert raw(url, "GET", "/")[0] == 200  # the server is fine
        client.reset(task)  # and so is the other instance
        assert client.step("look around").observation.startswith("This room is called")
        assert raw(url, "POST", "/reset", {"id": iid, "data_idx": task})[0] == 200  # a fresh JVM
        assert raw(url, "GET", f"/detail?id={iid}")[1]["jvm_pid"] not in (None, pid)
        assert raw(url, "POST", "/step", {"id": iid, "action": "look around"})[0] == 200
    finally:
        raw(url, "POST", "/close", {"id": iid})


@needs_jvm
def test_jvm_cap(server, client):
    url = server.url
    client.reset(0)  # holds one JVM
    ids = [raw(url, "POST", "/create", {})[1]["id"] for _ in range(2)]
    assert raw(url, "POST", "/reset", {"id": ids[0], "data_idx": 0})[0] == 200
    status, out = raw(url, "POST", "/reset", {"id": ids[1], "data_idx": 0})
    assert status == 503 and "--max-jvms" in out["error"]
    assert raw(url, "GET", f"/detail?id={ids[1]}")[1]["jvm_pid"] is None
    raw(url, "POST", "/close", {"id": ids[0]})  # gives its JVM back
    assert raw(url, "POST", "/reset", {"id": ids[1], "data_idx": 0})[0] == 200
    raw(url, "POST", "/close", {"id": ids[1]})
