"""TextCraft in-process: grammar, observations, rewards, determinism, the expert, splits, the
loaders."""

import argparse
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from env_server.base import TaskError
from env_server.textcraft import TextCraftEnv, task_commands
from env_server.textcraft_world import (BOOK_PATH, SPLITS_PATH, build_world, read_datapack,
                                        read_recipe_book, split_rule)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_RECIPES = (os.environ.get("TEXTCRAFT_RECIPES")
                  or os.path.join(ROOT, "..", "shared", "textcraft-recipes"))
needs_shared = pytest.mark.skipif(
    not os.path.isdir(SHARED_RECIPES),
    reason=f"upstream's recipe folder not found at {SHARED_RECIPES} "
           f"(set TEXTCRAFT_RECIPES to point at it)")


@pytest.fixture(scope="module")
def world():
    return TextCraftEnv.load_world(None)


@pytest.fixture(scope="module")
def datapack_world():
    return TextCraftEnv.load_world(argparse.Namespace(recipes=SHARED_RECIPES))


def start(world, goal):
    env = TextCraftEnv(world)
    first = env.reset(world.goals.index("minecraft:" + goal.replace(" ", "_")))
    return env, first


def obs(env, action):
    return env.step(action).observation


# ---- the built-in recipe book ----
def test_builtin_book_shape(world):
    depths = Counter(world.depth[g] for g in world.goals)
    assert set(depths) == {1, 2, 3, 4} and min(depths.values()) >= 20, depths
    assert TextCraftEnv.num_tasks(world) == len(world.goals) > 300
    # every line of the book survives upstream's filters (no cycles, no "from one block" recipes)
    assert sum(len(v) for v in world.item_recipes.values()) == len(read_recipe_book(BOOK_PATH))
    assert [world.depth[g] for g in world.goals] == sorted(world.depth[g] for g in world.goals)


def test_depths_follow_the_recipe_tree(world):
    d = {name: world.depth["minecraft:" + name] for name in
         ["oak_log", "oak_planks", "stick", "dark_oak_sign", "redstone_torch", "activator_rail",
          "planks"]}
    assert d == {"oak_log": 0, "oak_planks": 1, "stick": 2, "dark_oak_sign": 3, "redstone_torch": 3,
                 "activator_rail": 4, "planks": 1}
    idx = world.goals.index("minecraft:activator_rail")
    assert TextCraftEnv.task_category(world, idx) == "depth_4"


# ---- observations and grammar ----
def test_first_observation_lists_tree_and_distractors(world):
    env, first = start(world, "dark oak sign")
    head, goal_line = first.split("\n\n")
    assert head.startswith("Crafting commands:\n") and goal_line == "Goal: craft dark oak sign."
    commands = head.split("\n")[1:]
    assert commands == env.commands and len(set(commands)) == len(commands)
    tree = {"craft 3 dark oak sign using 6 dark oak planks, 1 stick",
            "craft 4 stick using 2 planks",
            "craft 4 dark oak planks using 1 dark oak log", "craft 4 oak planks using 1 oak log"}
    assert tree <= set(commands)
    n_tree = 2 + 8  # sign, stick, and the 8 planks recipes that the tag "planks" stands for
    assert n_tree < len(commands) <= n_tree + 10
    assert env.observation() == first


def test_get_and_inventory(world):
    env, _ = start(world, "dark oak sign")
    assert obs(env, "inventory") == "Inventory: You are not carrying anything."
    assert obs(env, "get 2 dark oak log") == "Got 2 dark oak log"
    assert obs(env, "get 1 dark oak planks") == "Could not find dark oak planks"  # craftable: no
    assert obs(env, "get 1 planks") == "Could not find planks"  # a generic tag: no
    assert obs(env, "get 1 unobtainium") == "Could not find unobtainium"
    assert obs(env, "get 3 string") == "Got 3 string"
    assert obs(env, "inventory") == "Inventory: [dark oak log] (2) [string] (3) "
    assert obs(env, "get 02 string") == "Got 2 string"
    assert env.detail()["inventory"] == {"dark oak log": 2, "string": 5}
    assert obs(env, "dance") == "Could not execute dance"
    assert obs(env, "Inventory") == "Could not execute Inventory"  # commands are case-sensitive
    assert obs(env, "get two string") == "Could not execute get two string"
    assert env.observation() == "Could not execute get two string"


def test_craft_rules(world):
    env, _ = start(world, "dark oak sign")
    env.step("get 2 dark oak log")
    assert (obs(env, "craft 4 dark oak planks using 1 dark oak log")
            == "Crafted 4 minecraft:dark_oak_planks")
    # missing ingredients are reported before the recipe is checked
    missing = "Could not find enough items to craft minecraft:stick"
    assert obs(env, "craft 4 stick using 2 oak planks") == missing
    assert obs(env, "craft 4 stick using 2 planks") == missing  # a tag name is never held
    assert (obs(env, "craft 4 planks using 5 dark oak log")
            == "Could not find enough items to craft None")
    # held, but not a recipe: upstream's exact wording
    assert obs(env, "craft 4 stick using 1 dark oak planks") == (
        "Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
        "item_id='minecraft:stick'), count=4)")
    assert obs(env, "craft 4 planks using 1 dark oak log") == (
        "Could not find a valid recipe for ItemTagWithCount("
        "item_tag=ItemTag(tag='minecraft:planks', "
        "item_id=None), count=4)")
    assert obs(env, "craft 4 stick using planks") == "Wrong item format: planks"
    # a member of the group stands for the tag; the batch is the recipe's, whatever N says
    assert obs(env, "craft 9 stick using 2 dark oak planks") == "Crafted 4 minecraft:stick"
    assert env.detail()["inventory"] == {"dark oak log": 1, "dark oak planks": 2, "stick": 4}


def test_no_scaling_one_craft_is_one_batch(world):
    env, _ = start(world, "dark oak sign")
    env.step("get 2 oak log")
    env.step("craft 4 oak planks using 1 oak log")
    env.step("craft 4 oak planks using 1 oak log")
    before = dict(env.inventory)
    # 8 sticks would be two batches: counts must equal the recipe's, so this fails and nothing is
    # used
    assert obs(env, "craft 8 stick using 4 oak planks").startswith("Could not find a valid recipe")
    assert env.inventory == before
    assert obs(env, "craft 4 stick using 2 oak planks, 2 oak planks").startswith(
        "Could not find a valid")
    assert obs(env, "craft 4 stick using 2 oak planks, 1 stick").startswith("Could not find enough")
    assert obs(env, "craft 4 stick using 2 oak planks") == "Crafted 4 minecraft:stick"
    assert env.detail()["inventory"] == {"oak planks": 6, "stick": 4}


def test_reward_done_and_errors(world):
    env = TextCraftEnv(world)
    with pytest.raises(TaskError) as e:
        env.step("inventory")
    assert e.value.status == 409
    with pytest.raises(TaskError) as e:
        env.reset(len(world.goals))
    assert e.value.status == 404
    with pytest.raises(TaskError):
        env.reset(-1)
    with pytest.raises(TaskError):
        env.reset("3")
    env.reset(world.goals.index("minecraft:stick"))
    assert env.step("get 1 birch log").reward == 0
    assert env.step("craft 4 birch planks using 1 birch log").done is False
    r = env.step("craft 4 stick using 2 birch planks")
    assert (r.observation, r.reward, r.done) == ("Crafted 4 minecraft:stick", 1.0, True)
    assert env.detail()["done"] and env.detail()["reward"] == 1.0 and env.expert_action() is None
    with pytest.raises(TaskError) as e:
        env.step("inventory")
    assert e.value.status == 409
    env.reset(0)  # a finished instance can start again
    assert env.detail()["done"] is False and env.inventory == {}


def test_detail_and_available_actions(world):
    env, _ = start(world, "lantern")
    d = env.detail()
    assert {k: d[k] for k in ["goal", "depth", "category", "done", "reward", "steps"]} == {
        "goal": "lantern", "depth": 4, "category": "depth_4", "done": False, "reward": 0.0,
        "steps": 0}
    assert d["commands"] == env.commands and d["inventory"] == {}
    json.dumps(d)
    assert env.available_actions() == ["get N item",
                                       "craft N item using N ingredient, N ingredient",
                                       "inventory"]


# ---- determinism across processes ----
PROBE = """
import json, sys
from env_server.textcraft import TextCraftEnv
w = TextCraftEnv.load_world(None)
out = []
for i in [0, 7, 150, 333, len(w.goals) - 1]:
    env = TextCraftEnv(w)
    out.append([w.goals[i], env.reset(i), TextCraftEnv.expert_plan(w, i)])
print(json.dumps([out, TextCraftEnv.splits(w)]))
"""


def test_same_tasks_in_every_process():
    runs = []
    for seed in ["0", "12345"]:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=True)
        runs.append(p.stdout)
    assert runs[0] == runs[1]
    w = TextCraftEnv.load_world(None)
    assert task_commands(w, 150) == task_commands(w, 150)
    assert task_commands(w, 150) != task_commands(w, 151)


# ---- the expert ----
def run_expert(world, idx, max_turns=100):
    env = TextCraftEnv(world)
    env.reset(idx)
    for turn in range(1, max_turns + 1):
        action = env.expert_action()
        r = env.step(action)
        assert r.observation.startswith(("Got ", "Crafted ")), (world.goals[idx], action,
                                                                r.observation)
        if r.done:
            return turn
    raise AssertionError(f"expert did not finish {world.goals[idx]}")


def test_expert_solves_every_builtin_task_within_30_turns(world):
    turns = [run_expert(world, i) for i in range(len(world.goals))]
    assert max(turns) <= 30
    assert TextCraftEnv.expert_plan(world, 0)[-1].startswith("craft ")


def test_expert_recovers_after_mistakes(world):
    for goal in ["dark oak sign", "lectern", "gray banner", "painting", "activator rail"]:
        env, _ = start(world, goal)
        # detours: stray items, a different planks variant, a wasted craft, bad commands
        for action in ["get 3 birch log", "craft 4 birch planks using 1 birch log", "get 2 string",
                       "craft 1 white wool using 4 string", "craft 4 stick using 2 birch planks",
                       "get 5 cobblestone", "craft 1 stick using 1 birch planks", "dance"]:
            env.step(action)
        for _ in range(40):
            r = env.step(env.expert_action())
            assert r.observation.startswith(("Got ", "Crafted ")), (goal, r.observation)
            if r.done:
                break
        assert r.done and r.reward == 1.0


def test_expert_thought_walks_from_the_goal_to_the_action(world):
    env, first = start(world, "jungle button")
    listed = [line.split(" ", 2)[2] for line in first.splitlines() if line.startswith("craft ")]
    seen = []
    while not env.done:
        action = env.expert_action()
        thought = env.expert_thought(action)
        lines = thought.rstrip(".").split("; ")
        assert lines[0].startswith("jungle button using "), thought  # from the goal ...
        assert all(line in listed for line in lines), thought  # ... through listed recipes only
        seen.append((action, thought))
        env.step(action)
    assert seen == [
        ("get 1 jungle log",
         "jungle button using 1 jungle planks; jungle planks using 1 jungle log."),
        ("craft 4 jungle planks using 1 jungle log",
         "jungle button using 1 jungle planks; jungle planks using 1 jungle log."),
        ("craft 1 jungle button using 1 jungle planks", "jungle button using 1 jungle planks.")]
    # every expert step of every training task has a thought that ends at the item it gets or
    # crafts
    for idx in TextCraftEnv.splits(world)["train"][::7]:
        env = TextCraftEnv(world)
        env.reset(idx)
        while not env.done:
            action = env.expert_action()
            last = env.expert_thought(action).rstrip(".").split("; ")[-1]
            item = (action.split(" using ")[0].split(" ", 2)[2] if action.startswith("craft")
                    else None)
            assert (last.startswith(f"{item} using ") if item
                    else last.endswith(action.split(" ", 2)[2])
                    or f" {action.split(' ', 2)[2]}," in last), (action, last)
            env.step(action)


def test_checked_thought_says_which_ingredients_a_listed_command_crafts(world):
    env, first = start(world, "jungle button")
    assert env.expert_thought("get 1 jungle log", checked=True) == (
        "jungle button using 1 jungle planks (jungle planks: craft); "
        "jungle planks using 1 jungle log (jungle log: get).")
    # on a spread of training tasks: each recipe's ingredients, in order, marked `craft` exactly
    # where a command of the task's own list makes the item or a member of its tag (read here from
    # the text)
    for idx in TextCraftEnv.splits(world)["train"][::9]:
        env = TextCraftEnv(world)
        first = env.reset(idx)
        made = {line.split(" using ")[0].split(" ", 2)[2] for line in first.splitlines()
                if line.startswith("craft ")}
        while not env.done:
            action = env.expert_action()
            plain, checked = env.expert_thought(action), env.expert_thought(action, checked=True)
            parts = checked.rstrip(".").split("; ")
            assert [p.split(" (")[0] for p in parts] == plain.rstrip(".").split("; "), checked
            for part in parts:
                ingredients = [i.split(" ", 1)[1]
                               for i in part.split(" using ")[1].split(" (")[0].split(", ")]
                marks = dict(m.split(": ") for m in part.split(" (")[1].rstrip(")").split(", "))
                assert list(marks) == ingredients, part
                for name, kind in marks.items():
                    crafted = name in made or any(m.endswith(" " + name) for m in made
                                                  if name in world_tags(world))
                    assert kind == ("craft" if crafted else "get"), (part, name)
            env.step(action)


def world_tags(world) -> set:
    """Tag names as the commands show them ('planks', 'wool'...)."""
    return {t.split(":", 1)[1].replace("_", " ") for t in world.tags}


# ---- splits ----
def check_splits(world, splits):
    train, test = set(splits["train"]), set(splits["test"])
    assert not train & test and train | test == set(range(len(world.goals)))
    # stratified: every depth in both parts, ~20% test
    for d in {world.depth[g] for g in world.goals}:
        ids = {i for i, g in enumerate(world.goals) if world.depth[g] == d}
        assert ids & test and ids & train
        assert abs(len(ids & test) - 0.2 * len(ids)) <= 1


def test_shipped_splits(world):
    splits = TextCraftEnv.splits(world)
    check_splits(world, splits)
    # the shipped file is the rule's output for the shipped book (regenerate with --write-splits)
    assert splits == split_rule(world.goals, world.depth)
    with open(SPLITS_PATH) as f:
        assert json.load(f)["test"] == splits["test"]


# ---- datapack loader ----
def write_pack(folder, recipes):
    for name, recipe in recipes.items():
        (folder / f"{name}.json").write_text(json.dumps(recipe))


def shaped(result, pattern, key, count=1, group=None):
    d = {"type": "minecraft:crafting_shaped", "pattern": pattern, "key": key,
         "result": {"item": result, "count": count}}
    return d | ({"group": group} if group else {})


def test_datapack_rules_on_a_tiny_pack(tmp_path):
    write_pack(tmp_path, {
        "a_planks": {"type": "minecraft:crafting_shapeless", "group": "planks",
                     "ingredients": [{"tag": "minecraft:a_logs"}],
                     "result": {"item": "minecraft:a_planks", "count": 4}},
        "b_stick": shaped("minecraft:stick", ["#", "#"], {"#": {"tag": "minecraft:planks"}},
                          count=4),
        "c_ingot": shaped("minecraft:ingot", ["###", "###", "###"],
                          {"#": {"item": "minecraft:nugget"}}),
        # closes a cycle: dropped
        "d_nugget": {"type": "minecraft:crafting_shapeless",
                     "ingredients": [{"item": "minecraft:ingot"}],
                     "result": {"item": "minecraft:nugget", "count": 9}},
        # from a block: dropped
        "e_from_block": {"type": "minecraft:crafting_shapeless",
                         "ingredients": [{"item": "minecraft:x_block"}],
                         "result": {"item": "minecraft:ingot", "count": 9}},
        "f_torch": {"type": "minecraft:crafting_shapeless",
                    "ingredients": [[{"item": "minecraft:coal"}, {"item": "minecraft:charcoal"}],
                                    {"item": "minecraft:stick"}, {"item": "minecraft:stick"}],
                    "result": {"item": "minecraft:torch", "count": 4}},
        "g_smelt": {"type": "minecraft:smelting", "ingredient": {"item": "minecraft:sand"},
                    "result": "minecraft:glass"},
    })
    w = build_world(read_datapack(str(tmp_path)), "tiny")
    assert sorted(w.goals) == ["minecraft:a_planks", "minecraft:ingot", "minecraft:stick",
                               "minecraft:torch"]
    # a dead tag is a base item
    assert "minecraft:a_logs" in w.items and "minecraft:planks" in w.tags
    (torch,) = w.item_recipes["minecraft:torch"]
    # alternatives: the first; repeats merge
    assert torch.text == "craft 4 torch using 1 coal, 2 stick"
    assert w.depth["minecraft:torch"] == 3 and w.depth["minecraft:ingot"] == 1
    env = TextCraftEnv(w)
    env.reset(w.goals.index("minecraft:torch"))
    assert obs(env, "get 1 a logs") == "Got 1 a logs"
    # its recipe was dropped, so it is a base item
    assert obs(env, "get 9 nugget") == "Got 9 nugget"
    assert obs(env, "get 1 glass") == "Could not find glass"  # smelting results do not exist
    assert run_expert(w, w.goals.index("minecraft:torch")) == 5


def test_bad_recipes_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TextCraftEnv.load_world(argparse.Namespace(recipes=missing))
    with pytest.raises(FileNotFoundError, match=str(tmp_path.name)):
        TextCraftEnv.load_world(argparse.Namespace(recipes=str(tmp_path)))  # no .json files
    parser = argparse.ArgumentParser()
    TextCraftEnv.add_args(parser)
    assert (parser.parse_args(["--recipes", "X"]).recipes == "X"
            and parser.parse_args([]).recipes is None)


@needs_shared
def test_datapack_reproduces_upstream_goals(datapack_world):
    w = datapack_world
    assert len(w.goals) == 544
    assert Counter(w.depth[g] for g in w.goals) == {1: 125, 2: 291, 3: 117, 4: 11}
    check_splits(w, TextCraftEnv.splits(w))
    env = TextCraftEnv(w)
    env.reset(w.goals.index("minecraft:dark_oak_sign"))
    assert "craft 4 dark oak planks using 1 dark oak logs" in env.commands
    assert obs(env, "get 1 dark oak logs") == "Got 1 dark oak logs"


@needs_shared
def test_expert_solves_every_datapack_task(datapack_world):
    w = datapack_world
    slow = {w.goals[i]: t for i in range(len(w.goals)) if (t := run_expert(w, i)) > 30}
    # Upstream's rules make iron and gold ingots craftable only from nuggets (the block recipes are
    # dropped, the nugget recipes close a cycle), so these two need 31+ and 45+ crafts by any route.
    assert set(slow) == {"minecraft:anvil", "minecraft:netherite_block"}, slow
