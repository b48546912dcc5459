"""Chance: the random policy (rollout.RandomPolicy over agents.random_moves) that stands beside
every held-out rate. On Corridor its success is a random walk's, which has an exact value."""

import json

import pytest

import eval as ev
from env_server import agents, get_env_class
from env_server.app import ServerProcess
from models.warmstart import LocalPool
from rollout import RandomPolicy, RolloutConfig, rollout


def walk_reaches(d: int, K: int) -> float:
    """The exact probability that a walk of +-1 steps, each side with probability 1/2, reaches +d
    within K steps (dynamic programming over positions, absorbed at d)."""
    at = {0: 1.0}
    reached = 0.0
    for _ in range(K):
        nxt: dict = {}
        for x, p in at.items():
            for y in (x - 1, x + 1):
                if y == d:
                    reached += p / 2
                else:
                    nxt[y] = nxt.get(y, 0.0) + p / 2
        at = nxt
    return reached


@pytest.fixture(scope="module")
def corridor_url():
    with ServerProcess("corridor") as server:
        yield server.url


def test_the_exact_walk_values():
    # by hand: within 1 step 1/2; within 3 steps 1/2 + 1/8 (left, right, right)
    assert walk_reaches(1, 1) == 0.5 and walk_reaches(1, 3) == 0.625
    assert walk_reaches(3, 8) == pytest.approx(0.2890625)  # 74 / 256


def test_random_corridor_policy_walks_as_a_random_walk():
    """12 test tasks (distance 3) x 200 episodes at K = 8, in this process: the share that
    reaches the goal is the exact walk's 28.9% within 4 standard errors (3.7 points)."""
    cls = get_env_class("corridor")
    world = cls.load_world(None)
    tasks = cls.splits(world)["test"]
    items = [t for t in tasks for _ in range(200)]
    pool = LocalPool(cls, world, [0] * len(items))
    trajs = rollout(RandomPolicy("corridor", seed=0), pool, "corridor", items,
                    list(range(len(items))), RolloutConfig(max_turns=8))
    won = sum(t.status == "done" and t.reward > 0 for t in trajs) / len(trajs)
    exact = walk_reaches(3, 8)
    se = (exact * (1 - exact) / len(trajs)) ** 0.5
    assert abs(won - exact) < 4 * se, (won, exact)
    # each reply is one move, in the game's form
    assert {m["content"] for t in trajs for m in t.messages[3::2]} == {"left", "right"}


def test_random_moves_per_game():
    first = ("Crafting commands:\ncraft 4 oak planks using 1 oak log\n"
             "craft 1 stick using 2 oak planks\n\nGoal: craft stick.")
    msgs = [{"role": "user", "content": "instructions"}, {"role": "assistant", "content": "OK"},
            {"role": "user", "content": first}]
    assert agents.random_moves("textcraft", msgs) == [
        "craft 4 oak planks using 1 oak log", "craft 1 stick using 2 oak planks",
        "get 1 oak log", "get 2 oak planks", "inventory"]
    seen = 'You see a wall.\nAvailable actions: ["turn left", "move forward"]'
    assert agents.random_moves("babyai", msgs + [{"role": "user", "content": seen}]) == [
        "turn left", "move forward"]
    assert agents.random_moves("corridor", msgs) == ["left", "right"]
    with pytest.raises(ValueError, match="defines no random policy"):
        agents.random_moves("searchqa", msgs)


def test_eval_prints_chance_beside_a_policy_and_plays_the_random_one(tmp_path, corridor_url,
                                                                     capsys):
    """eval.py --random is chance as a policy; any other policy's result carries chance on the
    same episodes, and its table prints it."""
    out = str(tmp_path / "random.json")
    res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url, "--random",
                                 "--n", "50", "--max-turns", "8", "--out", out]))
    assert res["policy"] == "random" and res["chance"] is None
    assert abs(res["overall"]["avg@50"] - walk_reaches(3, 8)) < 0.06  # 600 episodes: 3 SE
    printed = capsys.readouterr().out
    assert "chance avg@" not in printed  # the random policy is not compared with itself
    with open(out) as f:
        assert json.load(f)["overall"]["samples"] == 600


def test_random_is_refused_with_a_model_or_where_the_game_has_no_random_policy(capsys):
    with pytest.raises(SystemExit):
        ev.parse_args(["--env", "corridor", "--random", "--model", "x"])
    assert "--random plays no model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ev.parse_args(["--env", "searchqa", "--random"])
    assert "--random: searchqa defines no random policy" in capsys.readouterr().err
