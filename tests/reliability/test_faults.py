"""Faults around a training run: hung games, env servers that die or come back, a broken game, and
instances lost with their server. Each fault costs only what it touches, and training goes on (or
stops with a clear message when there is nothing sound left to train on)."""

import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, raw
from toy_env import CounterEnv

from env_client import EnvClient, EnvError, EnvPool
from env_server.app import ServerProcess, serve_in_thread

FAULTY = os.path.join(ROOT, "tests", "reliability", "faulty_env.py")
TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4",
        "--threads", "1", "--eval-every", "0", "--schedule", "4"]


class ThreadedCounter(CounterEnv):
    batch_threads = 4  # a batch's ops on 4 threads (the SciWorld / Deep Search path)


# ---------------------------------------------------------------- the server: a hung game
# The --op-timeout of the hung-call tests below: the quick calls beside a hung one must fit in it
# on a loaded machine too (0.5 s left them little room), and a hung call's 504 still comes long
# before the game's own end ("sleep 30", a reset of 20 s).
OP_TIMEOUT_S = 2.0


@pytest.mark.parametrize("env_cls", [CounterEnv, ThreadedCounter])
def test_a_hung_call_costs_its_own_instance_only(env_cls):
    url, stop = serve_in_thread(env_cls, op_timeout_s=OP_TIMEOUT_S, first_id=0)
    try:
        for i in range(4):
            raw(url, "POST", "/create", {"data_idx": 0})
        t0 = time.monotonic()
        status, out = raw(url, "POST", "/batch", {"ops": [
            {"op": "step", "id": 0, "action": "add 1"},
            {"op": "step", "id": 1, "action": "sleep 30"},
            {"op": "step", "id": 2, "action": "add 1"},
            {"op": "step", "id": 3, "action": "add 3"}]})
        took = time.monotonic() - t0
        r = out["results"]
        assert status == 200 and took < 20, took  # the op timeout, not the hung game's 30 s
        assert r[1]["status"] == 504 and "--op-timeout" in r[1]["error"]
        assert r[0]["observation"] == r[2]["observation"] == "Total: 1" and r[3]["done"] is True
        # the hung instance answers at once from now on (not after waiting out the op timeout for
        # its lock), and can be closed; the others play on
        t0 = time.monotonic()
        status, e = raw(url, "POST", "/step", {"id": 1, "action": "add 1"})
        assert status == 503 and "hung" in e["error"] and time.monotonic() - t0 < OP_TIMEOUT_S
        assert raw(url, "POST", "/step", {"id": 0, "action": "add 2"})[1]["done"] is True
        status, e = raw(url, "POST", "/step", {"id": 2, "action": "sleep 30"})  # a single-step call
        assert status == 504
        assert raw(url, "POST", "/close", {"id": 1}) == (200, True)
        assert raw(url, "GET", "/")[1]["instances"] == 3
        assert raw(url, "POST", "/create", {"data_idx": 1})[0] == 200
    finally:
        stop()


class SlowToReset(CounterEnv):
    def reset(self, idx):
        if idx == 2:
            time.sleep(20)  # a reset that hangs (SciWorld's JVM starts on the first one)
        return super().reset(idx)


@pytest.mark.parametrize("batch", [False, True])
def test_a_create_whose_reset_hangs_costs_that_instance_only(batch):
    """A create that names a task resets it; if the reset hangs, the instance the create made is
    marked hung, as a hung /reset's is: closed at once, not held against the instance cap."""
    url, stop = serve_in_thread(SlowToReset, op_timeout_s=OP_TIMEOUT_S, first_id=0)
    try:
        if batch:
            status, out = raw(url, "POST", "/batch", {"ops": [{"op": "create", "data_idx": 2}]})
            status, e = out["results"][0]["status"], out["results"][0]
        else:
            status, e = raw(url, "POST", "/create", {"data_idx": 2})
            assert "instance 0:" in e["error"]
        assert status == 504 and "--op-timeout" in e["error"]
        t0 = time.monotonic()
        status, e = raw(url, "POST", "/step", {"id": 0, "action": "add 1"})
        assert status == 503 and "hung" in e["error"] and time.monotonic() - t0 < OP_TIMEOUT_S
        assert raw(url, "POST", "/close", {"id": 0}) == (200, True)
        assert raw(url, "GET", "/")[1]["instances"] == 0
        assert raw(url, "POST", "/create", {"data_idx": 1})[0] == 200
    finally:
        stop()


def step_with_headers(url: str, body: dict) -> tuple[int, dict, dict]:
    """POST /step; (status, JSON answer, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
    conn.request("POST", "/step", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = (resp.status, json.loads(resp.read()), dict(resp.getheaders()))
    conn.close()
    return out


def test_calls_queued_behind_a_slow_call_are_not_hung():
    """The deadline counts a call's own time, not its wait for the instance: six parallel 0.5 s
    steps on one instance under a 2 s deadline (the last waits 2.5 s) are each played or told the
    instance is busy (retry later); none is a 504, and the instance plays on. (Each call's own
    time is 1.5 s inside the deadline, room for a loaded machine.)"""
    url, stop = serve_in_thread(CounterEnv, op_timeout_s=2.0, first_id=0)
    try:
        raw(url, "POST", "/create", {"data_idx": 19})
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(
            step_with_headers(url, {"id": 0, "action": "sleep 0.5"}))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted(a[0] for a in answers)
        assert len(answers) == 6 and 200 in statuses and set(statuses) <= {200, 503}, answers
        for status, out, headers in answers:
            if status == 503:
                assert ("busy" in out["error"] and "hung" not in out["error"]
                        and headers["Retry-After"] == "1")
        assert raw(url, "POST", "/step", {"id": 0, "action": "add 1"})[0] == 200  # not hung
    finally:
        stop()


def test_a_call_queued_behind_a_hung_call_hears_so_at_once():
    """A call waiting for the instance of a call that turns out hung hears so when it is marked,
    not "busy" when its own wait runs out. It is sent once the first call is inside the game
    (however long that takes on a loaded machine: sent earlier, it could take the lock first), and
    half an op timeout later, so that its wait (one op timeout) ends a whole second after the
    first call's deadline."""
    entered = threading.Event()

    class Entered(CounterEnv):
        def step(self, action):
            entered.set()
            return super().step(action)

    url, stop = serve_in_thread(Entered, op_timeout_s=OP_TIMEOUT_S, first_id=0)
    try:
        raw(url, "POST", "/create", {"data_idx": 19})
        first = []
        t = threading.Thread(target=lambda: first.append(raw(url, "POST", "/step",
                                                             {"id": 0, "action": "sleep 30"})))
        t.start()
        assert entered.wait(60), "the first step never reached the game"
        time.sleep(OP_TIMEOUT_S / 2)
        status, e = raw(url, "POST", "/step", {"id": 0, "action": "add 1"})  # waits for the lock
        t.join()
        assert first[0][0] == 504
        assert status == 503 and "is hung" in e["error"], e
    finally:
        stop()


def test_idle_time_counts_from_the_end_of_a_call():
    """A call longer than the idle timeout must not leave its instance to the reaper the moment it
    returns, before the client's next request. The pause after the call (0.6 s) gives the reaper
    (every 0.5 s) a pass; the idle timeout (2 s) leaves 1.4 s beyond it for a loaded machine."""
    url, stop = serve_in_thread(CounterEnv, idle_timeout_s=2.0, first_id=0)
    try:
        raw(url, "POST", "/create", {"data_idx": 0})
        assert raw(url, "POST", "/step", {"id": 0, "action": "sleep 2.5"})[0] == 200
        time.sleep(0.6)
        assert raw(url, "POST", "/step", {"id": 0, "action": "add 1"})[0] == 200
    finally:
        stop()


def test_pool_replaces_instances_lost_with_their_server():
    """Killed mid-episode and started again on the same port: the steps in flight are env errors,
    and the next reset plays on new instances; the old ids are unknown to the new server (never
    reused)."""
    url, stop = serve_in_thread(CounterEnv)
    port = int(url.rsplit(":", 1)[1])
    pool = EnvPool(url, 4, retries=0)
    try:
        assert pool.reset([0, 1, 2, 3]) == ["Reach 3.", "Reach 4.", "Reach 5.", "Reach 6."]
        old = [c.id for c in pool.clients]
        stop()
        assert all(e.instance_lost for e in pool.step(["add 1"] * 4))
        assert all(e.kind == "connection" for e in pool.reset([0, 1, 2, 3]))  # still down
        url2, stop = serve_in_thread(CounterEnv, port=port)
        for cid in old:
            assert raw(url2, "POST", "/step", {"id": cid, "action": "add 1"})[0] == 404
        assert pool.reset([0, 1, 2, 3]) == ["Reach 3.", "Reach 4.", "Reach 5.", "Reach 6."]
        assert [s.done for s in pool.step(["add 3"] * 4)] == [True, False, False, False]
        assert not set(old) & {c.id for c in pool.clients}
    finally:
        pool.close()
        stop()


# ---------------------------------------------------------------- train.py against faulty servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faulty:
    """tests/reliability/faulty_env.py in a child process on a fixed port: .url, .kill(),
    .start()."""

    def __init__(self, *args: str, port: int | None = None):
        self.args, self.port = args, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        for _ in range(50):  # the port may still be held for a moment by the killed one
            self.proc = subprocess.Popen([sys.executable, FAULTY, "--port", str(self.port),
                                          *self.args],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
            if self.proc.stdout.readline().startswith("serving "):
                return
            self.proc.wait()
            time.sleep(0.2)
        raise RuntimeError("faulty server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def start_train(args, cache_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *args, "--cache-dir", cache_dir], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def rollouts(out_dir: str, step: int) -> list[dict]:
    with open(os.path.join(out_dir, "rollouts", f"step_{step:06d}.jsonl")) as f:
        return [json.loads(x) for x in f]


def wait_for(cond, timeout: float = 240.0, proc=None) -> None:
    t0 = time.time()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"train.py ended early: {finish(proc)[1][-3000:]}")
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def n_metrics(out_dir: str) -> int:
    path = os.path.join(out_dir, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_server_killed_mid_rollout_then_back(tmp_path, cache_dir):
    """The trajectories in flight become env errors and are not trained on; the run waits for the
    server, and once it is back the pool plays on new instances."""
    out = str(tmp_path / "run")
    with Faulty("--delay", "0.3") as server:
        proc = start_train([*TINY, "--steps", "4", "--out", out, "--env-addr", server.url,
                            "--env-wait", "60"],
                           cache_dir)
        wait_for(lambda: n_metrics(out) >= 1, proc=proc)
        time.sleep(0.5)  # inside step 2's rollout: every turn takes 0.3 s
        server.kill()
        threading.Timer(2.0, server.start).start()
        code, log = finish(proc)
        assert code == 0, log[-3000:]
    m = metrics(out)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    hit = [x for x in m if x["status_env_error"]]
    assert hit and hit[0]["step"] == 2 and hit[0]["skipped_update"] == 1
    assert m[-1]["status_env_error"] == 0 and m[-1]["skipped_update"] == 0 and "loss" in m[-1]
    rows = rollouts(out, 2)
    assert any(r["status"] == "env_error" and "connection" in r["error"] for r in rows)


def child_servers(pid: int) -> list[int]:
    """The env server processes started by `pid` (from /proc/*/stat: field 4 is the parent's
    pid)."""
    kids = []
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
            if d.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid and \
                    b"env_server" in open(f"/proc/{d}/cmdline", "rb").read():
                kids.append(int(d))
        except (OSError, ValueError):
            continue
    return kids


def test_a_local_server_that_dies_is_restarted(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    # enough steps that the kill, made after the first one, lands well before the last however
    # fast they are
    proc = start_train([*TINY, "--steps", "30", "--out", out], cache_dir)
    wait_for(lambda: n_metrics(out) >= 1, proc=proc)
    (pid,) = child_servers(proc.pid)
    os.kill(pid, signal.SIGKILL)
    code, log = finish(proc)
    assert code == 0, log[-3000:]
    assert "env server died" in log and "restarting it" in log
    assert [x["step"] for x in metrics(out)] == list(range(1, 31))
    assert metrics(out)[-1]["status_env_error"] == 0


def test_a_hung_game_hits_its_timeout(tmp_path, cache_dir):
    """Task 0 never answers a step: its trajectories end as env errors after --op-timeout, the
    server's deadline; task 1's are played and trained on, step after step."""
    out, tasks = str(tmp_path / "run"), tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"train": [0, 1], "test": []}))
    with Faulty("--hang-task", "0", "--op-timeout", "1") as server:
        code, log = finish(start_train([*TINY, "--steps", "2", "--out", out,
                                        "--env-addr", server.url,
                                        "--tasks-file", str(tasks)], cache_dir))
    assert code == 0, log[-3000:]
    for x in metrics(out):
        assert x["status_env_error"] == 2 and x["skipped_update"] == 0 and "loss" in x
    errors = [r["error"] for r in rollouts(out, 2) if r["status"] == "env_error"]
    assert [r["item_id"] for r in rollouts(out, 2) if r["status"] == "env_error"] == [0, 0]
    assert all("504" in e and "--op-timeout" in e for e in errors)


def test_too_many_env_errors_stop_the_run(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    with Faulty("--fail") as server:
        code, log = finish(start_train([*TINY, "--steps", "6", "--out", out,
                                        "--env-addr", server.url,
                                        "--env-error-patience", "2"], cache_dir))
    assert code == 1, log[-3000:]
    assert "--max-env-error-share" in log and "injected fault" in log and "--resume" in log
    m = metrics(out)
    assert [x["step"] for x in m] == [1, 2] and all(x["skipped_update"] == 1 for x in m)
    # the count goes on in a resumed run: one more such step stops it, as it would have
    state = torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"), weights_only=True)
    assert state["step"] == 2 and state["bad_steps"] == 2


# ------------------------------------------------------------- SciWorld: a JVM that stops answering
SCIWORLD_MISSING = ("the scienceworld package is not installed"
                    if importlib.util.find_spec("scienceworld") is None
                    else "java is not on PATH" if shutil.which("java") is None else None)


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped. kill() returns once the signal
    is queued: one thread takes it when it next runs and only then stops the others, which run on
    meanwhile (on a loaded machine for tens of ms: a JVM answers a whole step in that time)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited meanwhile
                pass
        if all(state in ("t", "T", "Z", "X") for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} did not stop within {timeout_s:g} s: {states}")
        time.sleep(0.001)


@pytest.mark.skipif(SCIWORLD_MISSING is not None,
                    reason=f"ScienceWorld cannot run: {SCIWORLD_MISSING}")
def test_a_frozen_jvm_costs_its_own_instance_only():
    """A JVM that is alive but never answers (SIGSTOP) would block its caller forever: the server's
    deadline answers 504, the other instance plays on, and closing the hung one kills its JVM. (A
    JVM that dies outright: tests/test_sciworld.py.)"""
    # --op-timeout 20: a reset on a loaded 2-core machine has taken more than 8 s
    with ServerProcess("sciworld", "--max-jvms", "2", "--op-timeout", "20", "--threads", "4") as s:
        a, b = EnvClient(s.url), EnvClient(s.url)
        try:
            a.reset(0)
            b.reset(0)
            pid = a.detail()["jvm_pid"]
            freeze(pid)  # every thread stopped: none answers the step below
            t0 = time.monotonic()
            with pytest.raises(EnvError) as e:
                a.step("look around")
            assert e.value.status == 504 and time.monotonic() - t0 < 40
            assert b.step("look around").observation.startswith("This room is called")
            a.close()
            for _ in range(100):  # the JVM is killed (a zombie until the server reaps it, or gone)
                try:
                    if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX":
                        break
                except FileNotFoundError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the frozen JVM was not killed")
            c = EnvClient(s.url)  # its JVM slot is free again, once the gateway has shut down
            for _ in range(100):
                try:
                    c.reset(0)
                    break
                except EnvError as e:
                    assert e.status == 503 and "--max-jvms" in e.message
                    time.sleep(0.1)
            print(f"slot free after {time.monotonic() - t0:.1f} s")
            c.close()
        finally:
            b.close()
