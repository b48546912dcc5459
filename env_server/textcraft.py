"""TextCraft: craft a Minecraft-style item from base items by text commands.

The game of ADaPT (Prasad et al., 2023) as AgentGym serves it (agentenv-textcraft), re-implemented.
Commands, matched at the start of the action and case-sensitive, as upstream:

    get N item                     -> "Got N item"                  (base items only)
    craft N item using N a, N b    -> "Crafted K minecraft:item"    (K = the recipe's batch size)
    inventory                      -> "Inventory: [a] (2) [b] (1) "
                                      or "Inventory: You are not carrying anything."

Anything else -> "Could not execute <action>". A craft succeeds when the listed ingredients are held
and match one recipe of the item exactly: the same items (an item of group "planks", e.g. "dark oak
planks", stands for the generic tag "planks"), the same counts. One craft makes exactly one batch: the
N in front of the item is ignored, the ingredient counts are never scaled (upstream's rule). Reward 1 and
done when the goal is crafted. The first observation lists the goal's recipe tree plus up to 10
distractors that use the same ingredients, shuffled, then "Goal: craft X.".

Worlds: the project's own recipe book (data/textcraft_recipes.txt) or, with `--recipes DIR`, a Minecraft
datapack recipe folder read by upstream's rules (shaped/shapeless only; recipes that turn one "*_block"
into items are dropped; a recipe that would close a dependency cycle is dropped; a tag with no craftable
member becomes a base item). Files are read in sorted name order: which recipe of a cycle survives
depends on the order, and this one gives upstream's published 544 goals of depth 1/2/3/4: 125/291/117/11.

Departures from upstream, all for determinism or correctness:
- tasks are ordered by (depth, item id), not by filesystem and hash order; distractors are sampled by
  `random.Random(task id)` from sorted lists, so a task id is the same task in every process;
- the recipe book is never modified (upstream's tree walk appends to its recipe lists, so what `craft`
  accepts drifts over resets);
- a task id out of range is an error (upstream wraps it), and so is a step after done;
- a count of more than 9 digits does not parse, so the command fails as an unparsable one does (upstream
  raises past 4300 digits, where Python 3.11+ refuses int()).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
from collections import Counter

from .base import Env, StepResult, TaskError

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BOOK_PATH = os.path.join(DATA_DIR, "textcraft_recipes.txt")
SPLITS_PATH = os.path.join(DATA_DIR, "textcraft_splits.json")
NS = "minecraft:"
MAX_DISTRACTORS = 10  # upstream: at most 10 distractor commands, and 10 sampled uses per ingredient
TEST_FRACTION = 0.2

# The command grammar (upstream's, compiled once). `match` anchors at the start only, like upstream.
# Counts have at most 9 digits: int() refuses more than 4300, and no game needs a billion items.
_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]{1,9}) (.*)")
_COUNT = re.compile(r"([0-9]{1,9}) (.*)")


def to_id(name: str) -> str:
    """'dark oak planks' -> 'minecraft:dark_oak_planks' (how the game reads typed names)."""
    return NS + name.replace(" ", "_")


def to_name(item_id: str) -> str:
    """'minecraft:dark_oak_planks' -> 'dark oak planks' (how the game shows ids)."""
    return item_id.replace(NS, "").replace("_", " ")


# ---------------------------------------------------------------------------------------------------
# World: recipes, tags, depths and goals; built once per process, read-only afterwards
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ingredient:
    name: str  # an item id, or a tag id when is_tag
    count: int
    is_tag: bool


@dataclasses.dataclass(frozen=True)
class Recipe:
    output: str  # item id
    count: int  # batch size: how many one craft makes
    group: str | None  # tag id of the output's group ("minecraft:planks"), if any
    inputs: tuple[Ingredient, ...]
    text: str  # the crafting command as listed to the agent


@dataclasses.dataclass(frozen=True)
class World:
    source: str  # "builtin" or the datapack folder
    items: frozenset  # ids that can be held
    tags: frozenset  # generic tag ids (cannot be held; a member item stands for them)
    item_tag: dict  # item id -> the tag of its group
    item_recipes: dict  # item id -> tuple[Recipe], in load order
    tag_recipes: dict  # tag id -> recipes of its group
    uses: dict  # item or tag id -> recipes that take it as an ingredient
    depth: dict  # item or tag id -> crafting-tree depth (0 for base items)
    goals: tuple  # task id -> goal item id
    expert_recipe: dict  # item id -> the recipe the expert uses
    tag_members: dict  # tag id -> member items the expert may substitute, preferred first
    splits: dict  # {"train": [...], "test": [...]}


def read_recipe_book(path: str) -> list[tuple]:
    """Parse the project's recipe book: `4 oak planks <- 1 oak log @ planks`; `#planks` is a tag."""
    raw = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):  # a comment (an ingredient "#tag" never starts a line)
                continue
            try:
                head, body = line.split("<-")
                body, _, group = body.partition("@")
                count, out = head.strip().split(" ", 1)
                inputs = []
                for part in body.split(","):
                    n, name = part.strip().split(" ", 1)
                    is_tag = name.startswith("#")
                    inputs.append((to_id(name.lstrip("#").strip()), int(n), is_tag))
                group_id = to_id(group.strip()) if group.strip() else None
                raw.append((to_id(out.strip()), int(count), group_id, inputs))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: cannot parse recipe {line!r} ({e})") from None
    return raw


def read_datapack(folder: str) -> list[tuple]:
    """Read Minecraft datapack recipe JSON files (shaped and shapeless), in sorted file order."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--recipes: no such folder: {folder}")
    if os.path.isdir(os.path.join(folder, "recipes")):  # upstream's layout: DIR/recipes/*.json
        folder = os.path.join(folder, "recipes")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    if not files:
        raise FileNotFoundError(f"--recipes: no recipe .json files in {folder}")
    raw = []
    for fname in files:
        path = os.path.join(folder, fname)
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        inputs = []  # (name, count, is_tag), in the file's key/ingredient order
        if d.get("type") == "minecraft:crafting_shaped":
            for key, ing in d["key"].items():
                n = sum(row.count(key) for row in d["pattern"])
                inputs.append(_ingredient(ing, n, path))
        elif d.get("type") == "minecraft:crafting_shapeless":
            for ing in d["ingredients"]:  # repeated ingredients merge into one count
                name, _, is_tag = _ingredient(ing, 1, path)
                for i, (other, n, _) in enumerate(inputs):
                    if other == name:
                        inputs[i] = (name, n + 1, is_tag)
                        break
                else:
                    inputs.append((name, 1, is_tag))
        else:
            continue  # smelting, stonecutting, special recipes: not crafting-table games
        result = d["result"]
        if isinstance(result, str):
            out, count = result, 1
        elif "item" in result:
            out, count = result["item"], result.get("count") or 1
        else:
            raise ValueError(f"{path}: result without an item: {result}")
        if not inputs:
            raise ValueError(f"{path}: recipe without ingredients")
        group = NS + d["group"] if "group" in d else None
        raw.append((out, count, group, inputs))
    return raw


def _ingredient(ing, count: int, path: str) -> tuple:
    if isinstance(ing, list):  # alternatives: upstream takes the first
        ing = ing[0]
    if "item" in ing:
        return ing["item"], count, False
    if "tag" in ing:
        return ing["tag"], count, True
    raise ValueError(f"{path}: ingredient without item or tag: {ing}")


def build_world(raw: list[tuple], source: str) -> World:
    """Turn raw recipes (output, count, group, [(name, count, is_tag)]) into a World, upstream's rules."""
    items, tags, item_tag = set(), set(), {}
    kept = []
    needs: dict[str, set] = {}  # output id -> everything it was made from, transitively
    for out, count, group, inputs in raw:
        items.update(name for name, _, is_tag in inputs if not is_tag)
        tags.update(name for name, _, is_tag in inputs if is_tag)
        items.add(out)
        if len(inputs) == 1 and inputs[0][0].endswith("_block"):
            continue  # "9 ingots from 1 block" would make a cycle with "1 block from 9 ingots"
        if group is not None and group != out:
            tags.add(group)
            item_tag[out] = group
        out_needs = needs.setdefault(out, set())
        if any(out in needs.get(name, ()) for name, _, _ in inputs):
            continue  # this recipe would close a cycle; the first one loaded wins, as upstream
        kept.append((out, count, group, inputs))
        for name, _, _ in inputs:
            out_needs.add(name)
            out_needs |= needs.get(name, set())

    # A tag none of whose members can be crafted is just an item one can `get` ("oak logs").
    craftable = {out for out, *_ in kept}
    members: dict[str, list] = {}
    for item, tag in item_tag.items():
        members.setdefault(tag, []).append(item)
    dead = {name for *_, inputs in kept for name, _, is_tag in inputs
            if is_tag and not any(m in craftable for m in members.get(name, ()))}
    items |= dead
    tags -= dead

    item_recipes, tag_recipes, uses = {}, {}, {}
    for out, count, group, inputs in kept:
        ings = tuple(Ingredient(name, n, is_tag and name not in dead) for name, n, is_tag in inputs)
        parts = ", ".join(f"{i.count} {to_name(i.name)}" for i in ings)
        text = f"craft {count} {to_name(out)} using {parts}"
        recipe = Recipe(out, count, group, ings, text)
        item_recipes.setdefault(out, []).append(recipe)
        if group is not None:
            tag_recipes.setdefault(group, []).append(recipe)
        for name in dict.fromkeys(i.name for i in ings):
            uses.setdefault(name, []).append(recipe)
    freeze = lambda d: {k: tuple(v) for k, v in d.items()}  # noqa: E731
    item_recipes, tag_recipes, uses = freeze(item_recipes), freeze(tag_recipes), freeze(uses)

    depth = _depths(item_recipes, tag_recipes)
    goals = tuple(sorted(item_recipes, key=lambda g: (depth[g], g)))
    expert_recipe, tag_members = _expert_tables(tags, item_tag, item_recipes, depth)
    return World(source, frozenset(items), frozenset(tags), item_tag, item_recipes, tag_recipes, uses,
                 depth, goals, expert_recipe, tag_members, split_rule(goals, depth))


def _depths(item_recipes: dict, tag_recipes: dict) -> dict:
    """Depth = min over recipes of (max over ingredients of depth + 1); base items have depth 0."""
    depth: dict[str, int] = {}

    def visit(name: str, path: tuple) -> int:
        if name in depth:
            return depth[name]
        if name in path:
            raise ValueError(f"recipe cycle: {' -> '.join(path + (name,))}")
        recipes = item_recipes.get(name) or tag_recipes.get(name) or ()
        d = min((max(visit(i.name, path + (name,)) + 1 for i in r.inputs) for r in recipes), default=0)
        depth[name] = d
        return d

    for name in list(item_recipes) + list(tag_recipes):
        visit(name, ())
    return depth


def _expert_tables(tags, item_tag, item_recipes, depth) -> tuple[dict, dict]:
    """Per item the recipe the expert uses (shallowest, then fewest commands); per tag its members."""
    cost: dict[str, int] = {}  # commands to make one batch from nothing, roughly

    def item_cost(name: str) -> int:
        if name not in item_recipes:
            return 1  # one `get`
        if name not in cost:
            cost[name] = min(recipe_cost(r) for r in item_recipes[name])
        return cost[name]

    def recipe_cost(r: Recipe) -> int:
        return 1 + sum(item_cost(best_member(i.name) if i.is_tag else i.name) for i in r.inputs)

    members: dict[str, list] = {}
    for item, tag in item_tag.items():
        if tag in tags and item not in tags:
            members.setdefault(tag, []).append(item)
    tag_members = {t: tuple(sorted(ms, key=lambda m: (depth.get(m, 0), m))) for t, ms in members.items()}

    def best_member(tag: str) -> str:
        return tag_members[tag][0]

    expert = {}
    for item, recipes in item_recipes.items():
        key = lambda r: (max(depth.get(i.name, 0) for i in r.inputs), recipe_cost(r))  # noqa: E731
        expert[item] = min(recipes, key=key)  # min keeps the first of equals: load order breaks ties
    return expert, tag_members


def split_rule(goals: tuple, depth: dict) -> dict:
    """Train/test ids: within each depth, a seeded shuffle puts ~20% of the goals in test."""
    rng = random.Random(0)
    train, test = [], []
    for d in sorted({depth[g] for g in goals}):
        ids = [i for i, g in enumerate(goals) if depth[g] == d]
        rng.shuffle(ids)
        n_test = round(len(ids) * TEST_FRACTION)
        test += ids[:n_test]
        train += ids[n_test:]
    return {"train": sorted(train), "test": sorted(test)}


def load_builtin_world() -> World:
    """The project's recipe book with the train/test split shipped next to it."""
    world = build_world(read_recipe_book(BOOK_PATH), "builtin")
    with open(SPLITS_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    splits = {"train": shipped["train"], "test": shipped["test"]}
    if sorted(splits["train"] + splits["test"]) != list(range(len(world.goals))):
        raise ValueError(f"{SPLITS_PATH} does not cover the {len(world.goals)} tasks of {BOOK_PATH}; "
                         "regenerate it: python -m env_server.textcraft --write-splits")
    return dataclasses.replace(world, splits=splits)


# ---------------------------------------------------------------------------------------------------
# Tasks and the expert
# ---------------------------------------------------------------------------------------------------
def task_commands(world: World, idx: int, variant: int = 0) -> list[str]:
    """The crafting commands shown for task `idx`: its recipe tree plus distractors, shuffled. Variant
    k > 0 draws other distractors in another order for the same goal (training-data augmentation)."""
    rng = random.Random(idx if variant == 0 else f"{idx}/{variant}")
    tree, seen, stack = [], set(), [world.goals[idx]]
    while stack:  # every recipe reachable from the goal through ingredients (tags: all their members)
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        recipes = world.item_recipes.get(name) or world.tag_recipes.get(name) or ()
        tree += recipes
        stack += [i.name for r in recipes for i in r.inputs]
    tree_texts = sorted({r.text for r in tree})
    pool = set()  # recipes that use an ingredient of the tree: plausible but useless commands
    for name in sorted({i.name for r in tree for i in r.inputs}):
        uses = world.uses.get(name, ())
        pool.update(r.text for r in rng.sample(uses, min(len(uses), MAX_DISTRACTORS)))
    distractors = sorted(pool.difference(tree_texts))
    commands = tree_texts + rng.sample(distractors, min(len(distractors), MAX_DISTRACTORS))
    rng.shuffle(commands)
    return commands


def expert_plan(world: World, goal: str, inventory: dict) -> list[str]:
    """Commands that craft `goal` from `inventory`: get the missing base items, then craft bottom-up."""
    inv = dict(inventory)
    # Getting earlier only adds items, so all gets go first, one per item: fewer turns.
    gets: dict[str, int] = {}
    crafts: list[str] = []

    def obtain(item: str, n: int) -> None:
        short = n - inv.get(item, 0)
        if short <= 0:
            return
        if item in world.expert_recipe:
            make(item, math.ceil(short / world.expert_recipe[item].count))
        else:
            gets[item] = gets.get(item, 0) + short
            inv[item] = n

    def make(item: str, batches: int) -> None:
        r = world.expert_recipe[item]
        parts = []
        for ing in r.inputs:
            need = ing.count * batches
            name = pick(ing.name, need) if ing.is_tag else ing.name
            obtain(name, need)
            inv[name] -= need  # set aside, so making the next ingredient cannot eat it
            parts.append(f"{ing.count} {to_name(name)}")
        crafts.extend([f"craft {r.count} {to_name(item)} using {', '.join(parts)}"] * batches)
        inv[item] = inv.get(item, 0) + r.count * batches

    def pick(tag: str, need: int) -> str:
        members = world.tag_members[tag]
        return next((m for m in members if inv.get(m, 0) >= need), members[0])

    make(goal, 1)  # crafting (not holding) the goal is what ends the task
    return [f"get {n} {to_name(item)}" for item, n in gets.items()] + crafts


# ---------------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------------
class TextCraftEnv(Env):
    name = "textcraft"

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--recipes", default=None, metavar="DIR",
                            help="Minecraft datapack recipe folder (JSON files); "
                                 "default: the project's own recipe book")

    @classmethod
    def load_world(cls, args: argparse.Namespace | None = None) -> World:
        folder = getattr(args, "recipes", None)
        if folder is None:
            return load_builtin_world()
        return build_world(read_datapack(folder), os.path.abspath(folder))

    @classmethod
    def num_tasks(cls, world: World) -> int:
        return len(world.goals)

    @classmethod
    def splits(cls, world: World) -> dict[str, list[int]]:
        return {k: list(v) for k, v in world.splits.items()}

    @classmethod
    def task_category(cls, world: World, idx: int) -> str:
        return f"depth_{world.depth[world.goals[idx]]}"

    @classmethod
    def expert_plan(cls, world: World, idx: int) -> list[str]:
        """The expert's whole command list for task `idx` from an empty inventory."""
        return expert_plan(world, world.goals[idx], {})

    def __init__(self, world: World):
        super().__init__(world)
        self.idx: int | None = None
        self.goal: str | None = None
        self.commands: list[str] = []
        self.inventory: dict[str, int] = {}  # item id -> count, in the order first obtained
        self.done = False
        self.reward = 0.0
        self.steps = 0
        self.last_observation = ""

    def reset(self, idx: int, variant: int = 0) -> str:
        """Task `idx`; `variant` k > 0 (in-process only, for SFT data) shows other distractors."""
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise TaskError(f"task id must be an integer, got {idx!r}")
        if not 0 <= idx < len(self.world.goals):
            raise TaskError(f"task id {idx} out of range 0..{len(self.world.goals) - 1}", 404)
        self.idx, self.goal = idx, self.world.goals[idx]
        self.commands = task_commands(self.world, idx, variant)
        self.inventory = {}
        self.done, self.reward, self.steps = False, 0.0, 0
        self.last_observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            "\n".join(self.commands), to_name(self.goal))
        return self.last_observation

    def step(self, action: str) -> StepResult:
        if self.goal is None:
            raise TaskError("no task: call reset first", 409)
        if self.done:
            raise TaskError("the episode is done: call reset to start another", 409)
        if not isinstance(action, str):
            raise TaskError(f"action must be a string, got {type(action).__name__}")
        reward = 0.0
        if m := _CRAFT.match(action):
            observation, crafted = self._craft(m[1], m[2])
            if crafted == self.goal:
                reward, self.done = 1.0, True
        elif m := _GET.match(action):
            observation = self._get(int(m[1]), m[2])
        elif action.startswith("inventory"):
            held = "".join(f"[{to_name(k)}] ({v}) " for k, v in self.inventory.items())
            observation = "Inventory: " + (held or "You are not carrying anything.")
        else:
            observation = f"Could not execute {action}"
        self.steps += 1
        self.reward += reward
        self.last_observation = observation
        return StepResult(observation, reward, self.done)

    def _get(self, amount: int, name: str) -> str:
        w, item = self.world, to_id(name)
        if item in w.item_recipes or item in w.tag_recipes or item in w.tags or item not in w.items:
            return f"Could not find {name}"
        self.inventory[item] = self.inventory.get(item, 0) + amount
        return f"Got {amount} {name}"

    def _craft(self, target: str, ingredients: str) -> tuple[str, str | None]:
        """Returns the observation and the id of the item crafted (None when the craft failed)."""
        w = self.world
        m = _COUNT.match(target)
        out_count, out_name = (int(m[1]), m[2]) if m else (1, target)
        out = to_id(out_name)
        out_is_tag = out in w.tags
        given = []  # [(item id, count)] as typed
        for part in ingredients.split(","):
            part = part.strip()
            if not (m := _COUNT.match(part)):
                return f"Wrong item format: {part}", None
            given.append((to_id(m[2]), int(m[1])))
        # Holding check first, as upstream; a typed tag name is never held.
        for item, n in given:
            if item in w.tags or self.inventory.get(item, -1) < n:
                return f"Could not find enough items to craft {None if out_is_tag else out}", None
        recipe = None if out_is_tag else self._match(out, given)
        if recipe is None:
            # Upstream prints the repr of its internal object here; kept verbatim, since agents trained
            # on upstream transcripts have seen exactly this text.
            tag, item = (out, None) if out_is_tag else (None, out)
            return ("Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag("
                    f"tag={tag!r}, item_id={item!r}), count={out_count})"), None
        for item, n in given:
            left = self.inventory[item] - n
            if left:
                self.inventory[item] = left
            else:
                del self.inventory[item]
        self.inventory[recipe.output] = self.inventory.get(recipe.output, 0) + recipe.count
        return f"Crafted {recipe.count} {recipe.output}", recipe.output

    def _match(self, out: str, given: list) -> Recipe | None:
        """The first recipe of `out` whose ingredients are exactly `given` (a member matches its tag)."""
        item_tag = self.world.item_tag
        for recipe in self.world.item_recipes.get(out, ()):
            left = list(given)
            for ing in recipe.inputs:
                j = next((j for j, (item, _) in enumerate(left)
                          if (item_tag.get(item) == ing.name if ing.is_tag else item == ing.name)), None)
                if j is None or left[j][1] != ing.count:  # the first match must have the right count
                    break
                del left[j]
            else:
                if not left:
                    return recipe
        return None

    def observation(self) -> str:
        """The latest observation (the first one right after reset), as upstream's /observation."""
        if self.goal is None:
            raise TaskError("no task: call reset first", 409)
        return self.last_observation

    def available_actions(self) -> list[str]:
        """Command templates; the concrete crafting commands are in the first observation."""
        return ["get N item", "craft N item using N ingredient, N ingredient", "inventory"]

    def detail(self) -> dict:
        if self.goal is None:
            return {"task_id": None, "done": False}
        depth = self.world.depth[self.goal]
        return {
            "task_id": self.idx,
            "goal": to_name(self.goal),
            "depth": depth,
            "category": f"depth_{depth}",
            "commands": list(self.commands),
            "inventory": {to_name(k): v for k, v in self.inventory.items()},
            "observation": self.last_observation,
            "steps": self.steps,
            "reward": self.reward,
            "done": self.done,
        }

    def expert_thought(self, action: str, checked: bool = False) -> str:
        """The reasoning behind the expert's `action`: the recipes on the way from the goal down to the
        item it crafts or fetches, each as `<item> using <ingredients>` (the listed command without its
        leading `craft N`), e.g. `jungle button using 1 jungle planks; jungle planks using 1 jungle log`.
        `checked` adds after each recipe what each ingredient is, read off the listed commands: `craft`
        where one of them makes it (a tag: one of its members), else `get`, e.g. `jungle button using 1
        jungle planks (jungle planks: craft); jungle planks using 1 jungle log (jungle log: get)`."""
        w = self.world
        m = _CRAFT.match(action) or _GET.match(action)
        target = to_id(_COUNT.match(m[1])[2] if action.startswith("craft") else m[2]) if m else None

        def path(item: str, seen: frozenset) -> list | None:
            if item == target:
                return []
            r = w.expert_recipe.get(item)
            if r is None or item in seen:
                return None
            for ing in r.inputs:
                for sub in (w.tag_members[ing.name] if ing.is_tag else [ing.name]):
                    rest = path(sub, seen | {item})
                    if rest is not None:
                        return [r] + rest
            return None

        chain = path(self.goal, frozenset()) or []
        if action.startswith("craft") and target in w.expert_recipe:
            chain.append(w.expert_recipe[target])
        made = {to_id(_COUNT.match(_CRAFT.match(c)[1])[2]) for c in self.commands} if checked else set()

        def marks(r: Recipe) -> str:  # ` (a: craft, b: get)`: does a listed command make each ingredient?
            if not checked:
                return ""
            return " (" + ", ".join(to_name(i.name) + (": craft" if made.intersection(
                w.tag_members[i.name] if i.is_tag else [i.name]) else ": get") for i in r.inputs) + ")"

        lines = [r.text.split(" ", 2)[2] + marks(r) for r in chain]
        return "; ".join(lines) + "." if lines else f"I will {action}."

    def expert_action(self) -> str | None:
        """The expert's next command from the current inventory (None once done or before reset)."""
        if self.goal is None or self.done:
            return None
        return expert_plan(self.world, self.goal, self.inventory)[0]


def main() -> None:
    """`python -m env_server.textcraft [--recipes DIR]` prints a world's goal counts."""
    parser = argparse.ArgumentParser(description="TextCraft world tools")
    parser.add_argument("--write-splits", action="store_true",
                        help=f"regenerate {SPLITS_PATH} from the built-in book by the split rule")
    TextCraftEnv.add_args(parser)
    args = parser.parse_args()
    if args.write_splits:
        world = build_world(read_recipe_book(BOOK_PATH), "builtin")
        with open(SPLITS_PATH, "w", encoding="utf-8") as f:
            json.dump({"rule": "per depth: random.Random(0) shuffle, first 20% -> test", **world.splits}, f)
            f.write("\n")
        print(f"wrote {SPLITS_PATH}: {len(world.splits['train'])} train, {len(world.splits['test'])} test")
        return
    world = TextCraftEnv.load_world(args)
    by_depth = sorted(Counter(world.depth[g] for g in world.goals).items())
    print(f"{world.source}: {len(world.goals)} goals; goals by depth: {dict(by_depth)}")


if __name__ == "__main__":
    main()
