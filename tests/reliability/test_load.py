"""Load: 256 parallel instances of each CPU env stepping at once, with zero errors; abandoned
instances reaped.

Every test runs a real server process (`python -m env_server NAME`, as train.py runs it) and drives
it with EnvPool: 256 instances reset to tasks spread over the train split (GET /tasks), then a fixed
number of steps for all of them at once. Each action is the env's expert's (GET /expert_action) for
a share of the instances, else a random action that succeeds, fails inside the game or is junk
(bench/soak.py's OTHER_ACTIONS, the same load the soak plays); an instance whose episode ended is
reset to another task. Asserted: no EnvError, every answer well formed, the server's live instance
count (health endpoint) 256 while playing and 0 after closing, nothing reaped. The measured steps/s
are printed (pytest -s) and never asserted: other jobs share this machine.

SciWorld starts one JVM of ~300-500 MB per instance: 256 would need ~100 GB of memory and this
machine has 24 GB, shared with other jobs. Its test runs 8 instances (--max-jvms 8, at most ~6 GB),
and is skipped without Java or the scienceworld package.
"""

import importlib.util
import random
import shutil
import time

import pytest
from conftest import raw

from bench.soak import Tally, play, spread
from env_client import EnvError, EnvPool
from tasks import task_splits
from env_server.app import ServerProcess

INSTANCES = 256
SCIWORLD_INSTANCES = 8  # one JVM each; see the module docstring
SCIWORLD_MISSING = ("the scienceworld package is not installed"
                    if importlib.util.find_spec("scienceworld") is None
                    else "java is not on PATH" if shutil.which("java") is None else None)


def health(url: str) -> dict:
    status, h = raw(url, "GET", "/")
    assert status == 200, h
    return h


def load(url: str, env: str, n: int, steps: int, expert_share: float, **pool_kw) -> None:
    """Create n instances, play `steps` steps with all of them at once, close them; assert that
    every answer was well formed and the live instance count followed. Prints the measured rates."""
    train = task_splits(url, env)["splits"]["train"]
    t0 = time.perf_counter()
    pool = EnvPool(url, n, **pool_kw)
    create_s = time.perf_counter() - t0
    try:
        assert health(url)["instances"] == n
        tally = Tally()
        t0 = time.perf_counter()
        play(pool, env, train, steps, random.Random(0), expert_share, tally)
        play_s = time.perf_counter() - t0
        assert tally.n_errors == 0, (f"{tally.n_errors} errors, first: "
                                     + "\n".join(tally.errors[:5]))
        assert tally.steps == n * steps and (tally.expert_actions > 0) == (expert_share > 0)
        h = health(url)
        assert h["instances"] == n and h["reaped"] == 0, h
    finally:
        pool.close()
    h = health(url)
    assert h["instances"] == 0 and h["reaped"] == 0, h
    mode = ("/batch" if pool.use_batch
            else f"one request per instance, {pool_kw.get('workers')} client threads")
    print(f"\n{env} ({mode}): {n} instances created in {create_s:.2f} s; "
          f"{n} x {steps} = {tally.steps} steps in "
          f"{play_s:.2f} s = {tally.steps / play_s:,.0f} steps/s "
          f"({tally.expert_actions} of them the expert's, "
          f"{tally.episodes} episodes restarted), 0 errors")


@pytest.mark.parametrize("env,steps,expert_share", [
    ("textcraft", 30, 0.5),
    ("babyai", 20, 0.1),  # its expert plans with minigrid's bot, ~10 ms a call: a few per step
    ("corridor", 30, 0.5),
    ("searchqa", 30, 0.5),
])
def test_256_instances_step_together(env, steps, expert_share):
    with ServerProcess(env) as server:
        load(server.url, env, INSTANCES, steps, expert_share)


def test_256_concurrent_clients_one_request_each():
    """No /batch: one HTTP request per instance per step from 256 client threads, as AgentGym's
    clients send them, so that the server's worker threads see 256 connections at once."""
    with ServerProcess("textcraft") as server:
        load(server.url, "textcraft", INSTANCES, 20, 0.5, use_batch=False, workers=INSTANCES)


@pytest.mark.skipif(SCIWORLD_MISSING is not None,
                    reason=f"ScienceWorld cannot run: {SCIWORLD_MISSING}")
def test_sciworld_instances_step_together():
    """8, not 256: one JVM per instance (see the module docstring)."""
    n = SCIWORLD_INSTANCES
    with ServerProcess("sciworld", "--max-jvms", str(n), "--threads", str(n)) as server:
        # No expert: its first call in an episode builds a gold path, seconds of CPU per instance (8
        # at once took 30 s here); tests/test_sciworld.py plays it. Random actions also end episodes
        # ("focus on").
        load(server.url, "sciworld", n, 10, 0.0)


def test_abandoned_instances_are_reaped_busy_ones_are_not():
    """256 instances left without /close are reaped after --idle-timeout, while 32 others, stepped
    more often than that, live on; a reaped instance then answers 404 saying so."""
    idle_timeout_s = 1.5
    with ServerProcess("corridor", "--idle-timeout", str(idle_timeout_s)) as server:
        busy, left = EnvPool(server.url, 32), EnvPool(server.url, INSTANCES)
        train = task_splits(server.url, "corridor")["splits"]["train"]
        assert all(isinstance(o, str)
                   for o in busy.reset(spread(train, 32)) + left.reset(spread(train, INSTANCES)))
        left_ids = [c.id for c in left.clients]
        left.clients = [None] * INSTANCES  # abandon them: EnvPool.close then sends no /close
        left.close()
        t_left = time.monotonic()
        assert health(server.url)["instances"] == 32 + INSTANCES

        # Keep the busy ones busy ("wait" never ends a corridor episode) until the others are gone.
        while (health(server.url)["instances"] > 32
               and time.monotonic() - t_left < 10 * idle_timeout_s):
            errors = [r for r in busy.step(["wait"] * 32) if isinstance(r, EnvError)]
            assert not errors, errors[:3]
            time.sleep(0.1)
        reaped_after_s = time.monotonic() - t_left
        h = health(server.url)
        assert h["instances"] == 32 and h["reaped"] == INSTANCES, h
        assert reaped_after_s >= idle_timeout_s
        status, e = raw(server.url, "POST", "/step", {"id": left_ids[0], "action": "left"})
        assert status == 404 and "reaped" in e["error"], e
        busy.close()
        h = health(server.url)
        assert h["instances"] == 0 and h["reaped"] == INSTANCES, h
    print(f"\n{INSTANCES} abandoned instances reaped {reaped_after_s:.2f} s after their last "
          f"request (--idle-timeout {idle_timeout_s:g}); 32 busy ones kept")
