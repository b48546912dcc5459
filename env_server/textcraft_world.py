"""TextCraft's world: recipes, tags, crafting depths, goals and the train/test split.

Worlds: the project's own recipe book (data/textcraft_recipes.txt) or, with `--recipes DIR`, a
Minecraft datapack recipe folder read by upstream's rules (shaped/shapeless only; recipes that turn
one "*_block" into items are dropped; a recipe that would close a dependency cycle is dropped; a tag
with no craftable member becomes a base item). Files are read in sorted name order: which recipe of
a cycle survives depends on the order, and this one gives upstream's published 544 goals of depth
1/2/3/4: 125/291/117/11.

Built once per process and read-only afterwards; env_server/textcraft.py plays tasks in it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BOOK_PATH = os.path.join(DATA_DIR, "textcraft_recipes.txt")
SPLITS_PATH = os.path.join(DATA_DIR, "textcraft_splits.json")
NS = "minecraft:"
TEST_FRACTION = 0.2


def to_id(name: str) -> str:
    """'dark oak planks' -> 'minecraft:dark_oak_planks' (how the game reads typed names)."""
    return NS + name.replace(" ", "_")


def to_name(item_id: str) -> str:
    """'minecraft:dark_oak_planks' -> 'dark oak planks' (how the game shows ids)."""
    return item_id.replace(NS, "").replace("_", " ")



# --------------------------------------------------------------------------------------------------
# World: recipes, tags, depths and goals; built once per process, read-only afterwards
# --------------------------------------------------------------------------------------------------
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
            # a comment (an ingredient "#tag" never starts a line)
            if not line or line.startswith("#"):
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
    """Turn raw recipes (output, count, group, [(name, count, is_tag)]) into a World, upstream's
    rules."""
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
    return World(source, frozenset(items), frozenset(tags), item_tag, item_recipes, tag_recipes,
                 uses, depth, goals, expert_recipe, tag_members, split_rule(goals, depth))


def _depths(item_recipes: dict, tag_recipes: dict) -> dict:
    """Depth = min over recipes of (max over ingredients of depth + 1); base items have depth 0."""
    depth: dict[str, int] = {}

    def visit(name: str, path: tuple) -> int:
        if name in depth:
            return depth[name]
        if name in path:
            raise ValueError(f"recipe cycle: {' -> '.join(path + (name,))}")
        recipes = item_recipes.get(name) or tag_recipes.get(name) or ()
        d = min((max(visit(i.name, path + (name,)) + 1 for i in r.inputs) for r in recipes),
                default=0)
        depth[name] = d
        return d

    for name in list(item_recipes) + list(tag_recipes):
        visit(name, ())
    return depth


def _expert_tables(tags, item_tag, item_recipes, depth) -> tuple[dict, dict]:
    """Per item the recipe the expert uses (shallowest, then fewest commands); per tag its
    members."""
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
    tag_members = {t: tuple(sorted(ms, key=lambda m: (depth.get(m, 0), m)))
                   for t, ms in members.items()}

    def best_member(tag: str) -> str:
        return tag_members[tag][0]

    expert = {}
    for item, recipes in item_recipes.items():
        key = lambda r: (max(depth.get(i.name, 0) for i in r.inputs), recipe_cost(r))  # noqa: E731
        # min keeps the first of equals: load order breaks ties
        expert[item] = min(recipes, key=key)
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
        raise ValueError(f"{SPLITS_PATH} does not cover the {len(world.goals)} tasks of "
                         f"{BOOK_PATH}; regenerate it: python -m env_server.textcraft "
                         "--write-splits")
    return dataclasses.replace(world, splits=splits)
