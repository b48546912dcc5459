"""Doors (env_server/doors.py), the horizon study's game: its rules, the short horizon's ceiling
by construction, the split, and chance against the exact value of a random walker."""

from functools import lru_cache

import pytest

from env_server import agents, get_env_class
from env_server.doors import DoorsEnv, kind
from models.warmstart import LocalPool
from rollout import RandomPolicy, RolloutConfig, rollout


def test_a_closed_door_stops_the_walker_until_it_opens_it_beside_it():
    env = DoorsEnv(None)
    assert kind(3) == (2, 2)
    assert env.reset(3) == "The goal is 2 steps to your right."
    assert env.step("open").observation == "The goal is 2 steps to your right."  # no door here
    step = env.step("right")
    assert step.observation == ("The goal is 1 step to your right. A closed door is on your "
                                "right.") and step.reward == 0.0
    assert env.step("right").observation.endswith("A closed door is on your right.")  # stopped
    assert env.detail() == {"goal": 2, "position": 1, "door": 2}
    assert env.step("left").observation == "The goal is 2 steps to your right."  # a step back
    env.step("right")
    assert env.step("right. open").observation == "The goal is 1 step to your right."  # the last
    step = env.step("go right")
    assert (step.observation, step.reward, step.done) == ("You reached the goal.", 1.0, True)


def test_no_door_task_fits_two_turns_and_the_expert_takes_distance_plus_one():
    """The short arm's ceiling, by the rules: a door stands 2 or more cells away (first seen after
    a move), and a goal behind one takes one turn more than its distance, never 2 or fewer."""
    env = DoorsEnv(None)
    for idx in range(DoorsEnv.num_tasks(None)):
        env.reset(idx)
        d, door = kind(idx)
        turns = 0
        while (a := env.expert_action()) is not None:
            turns += 1
            assert env.step(a).reward == (1.0 if env.done else 0.0)
        assert env.done and turns == d + (door is not None), idx
        assert door is None or (door >= 2 and turns >= 3)


def test_the_test_games_are_not_training_games():
    splits = DoorsEnv.splits(None)
    train = {kind(i) for i in splits["train"]}
    test = {kind(i) for i in splits["test"]}
    assert not train & test and {d for d, _ in test} == {3}
    # a door where training tasks have theirs: 2 cells away, or at the goal
    assert all(door in (None, 2, d) for d, door in test | train)
    assert {DoorsEnv.task_category(None, i) for i in splits["test"]} == {
        "distance_3", "distance_3_door_2", "distance_3_door_3"}


@lru_cache(None)
def walk_reaches(d: int, door: int | None, k: int, pos: int = 0, shut: bool = True) -> float:
    """A uniform left / right / open walker's chance of reaching the goal within k turns."""
    if pos == d:
        return 1.0
    if k == 0:
        return 0.0
    blocked = shut and door == pos + 1
    right = walk_reaches(d, door, k - 1, pos if blocked else pos + 1, shut)
    left = walk_reaches(d, door, k - 1, pos - 1, shut)
    opened = walk_reaches(d, door, k - 1, pos, shut and not blocked)
    return (right + left + opened) / 3


def test_a_random_walker_wins_as_often_as_the_exact_walk():
    """12 test tasks x 200 episodes at K = 10: within 4 standard errors of the exact chance
    (17.0%: 25.6% with no door, 12.7-12.8% behind one). A door is only ever on the goal's side."""
    cls = get_env_class("doors")
    tasks = cls.splits(None)["test"]
    exact = sum(walk_reaches(*kind(t), 10) for t in tasks) / len(tasks)
    assert exact == pytest.approx(0.1705, abs=5e-4)
    items = [t for t in tasks for _ in range(200)]
    trajs = rollout(RandomPolicy("doors", seed=0), LocalPool(cls, None, [0] * len(items)),
                    "doors", items, list(range(len(items))), RolloutConfig(max_turns=10))
    won = sum(t.status == "done" and t.reward > 0 for t in trajs) / len(trajs)
    assert abs(won - exact) < 4 * (exact * (1 - exact) / len(trajs)) ** 0.5, (won, exact)
    assert agents.random_moves("doors", []) == ["left", "right", "open"]


def test_train_py_plays_doors_from_its_warm_start_with_chance_beside(tmp_path):
    """The horizon study's game trains as any built-in one: its tiny model and random-mover warm
    start are built, two steps train, and the first held-out evaluation has chance beside it."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--env", "doors", "--schedule", "4",
                        "--steps", "2", "--batch-size", "4", "--group-size", "4",
                        "--max-new-tokens", "4", "--eval-every", "2", "--eval-samples", "2",
                        "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((out / "eval.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["tasks"] == 12 and 0.0 < first["chance"] < 0.5
    assert set(first["by_category"]) == {"distance_3", "distance_3_door_2", "distance_3_door_3"}
