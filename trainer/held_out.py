"""Held-out episodes during training (`held_out`: trainer/run.py scores them), and what eval.py
shares with it: a policy's player for rollout.play_in_chunks, the tasks' categories, the random
policy's sample count."""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from distributed import all_gather_list, global_rank, world_size
from env_client import EnvError
from env_server import get_env_class
from env_server.agents import served_here
from rollout import EnginePolicy, RolloutConfig, Trajectory, play_in_chunks, rollout

# Chance plays each task at least this many times: it needs no model, and an estimate from a
# policy's 4 samples a task would move by several points from run to run
CHANCE_SAMPLES = 32


def player(policy, env: str, rcfg: RolloutConfig, fmt, agent: str):  # for play_in_chunks
    def play(pool, items, groups, progress=None):
        return rollout(policy, pool, env, items, groups, rcfg, fmt=fmt, agent=agent,
                       progress=progress)
    return play


def categories_for(env: str, item_ids: list[int],
                   given: dict | None = None) -> dict[int, str]:
    """task id -> category: from `given` (a --tasks-file's), else the env's own
    `task_category` (TextCraft depth_k, BabyAI level); "all" where neither is (an env served
    elsewhere)."""
    if given:
        return {i: given.get(i, "all") for i in item_ids}
    cls = get_env_class(env) if served_here(env) else None
    if not hasattr(cls, "task_category"):
        return {i: "all" for i in item_ids}
    world = cls.load_world(None)
    return {i: cls.task_category(world, i) for i in item_ids}


def held_out(engine, fmt, url: str, env: str, test_ids: list[int], rcfg: RolloutConfig,
             step: int, generator, batch: int = 64, timeout: float = 120.0,
             agent: str = "react", samples: int = 1, policy=None) -> list[Trajectory]:
    """`samples` episodes per test task, sampled from `generator` (seeded alike each time), or
    played by a text `policy` (the random one: chance). Under torchrun each rank plays every
    N-th task and returns them all (token rows left out); trainer/run.py scores them."""
    mine = [i for i in test_ids[global_rank()::world_size()] for _ in range(samples)]
    groups = [k // samples for k in range(len(mine))]  # a task's samples share its group
    if policy is None:
        policy = EnginePolicy(engine, fmt, rcfg, generator)
    else:
        fmt = None  # a text policy: no token rows
    play = player(policy, env, rcfg, fmt, agent)
    try:  # a rank without a task (more ranks than tasks) plays nothing
        trajs = play_in_chunks(url, batch, mine, groups, play,
                               desc=f"held-out eval @ step {step}", leave=False,
                               timeout=timeout) if mine else []
    except EnvError as e:  # no env server to play on: no result this time; training goes on
        tqdm.write(f"held-out evaluation at step {step} failed: {e}")
        trajs = [Trajectory(env, i, -1, [], [], [], [], status="env_error") for i in mine]
    # every rank's episodes, on every rank, without the token rows (nothing here reads them)
    return all_gather_list([dataclasses.replace(t, token_ids=[], loss_mask=[], logprobs=[])
                            for t in trajs])
