"""TextCraft: craft a Minecraft-style item from base items by text commands.

The game of ADaPT (Prasad et al., 2023) as AgentGym serves it (agentenv-textcraft), re-implemented.
Commands, matched at the start of the action and case-sensitive, as upstream:

    get N item                     -> "Got N item"                  (base items only)
    craft N item using N a, N b    -> "Crafted K minecraft:item"    (K = the recipe's batch size)
    inventory                      -> "Inventory: [a] (2) [b] (1) "
                                      or "Inventory: You are not carrying anything."

Anything else -> "Could not execute <action>". A craft succeeds when the listed ingredients are held
and match one recipe of the item exactly: the same items (an item of group "planks", e.g. "dark oak
planks", stands for the generic tag "planks"), the same counts. One craft makes exactly one batch:
the N in front of the item is ignored, the ingredient counts are never scaled (upstream's rule).
Reward 1 and done when the goal is crafted. The first observation lists the goal's recipe tree plus
up to 10 distractors that use the same ingredients, shuffled, then "Goal: craft X.".

Worlds (the built-in recipe book, or a datapack with `--recipes DIR`):
env_server/textcraft_world.py.

Departures from upstream, all for determinism or correctness:
- tasks are ordered by (depth, item id), not by filesystem and hash order; distractors are sampled
  by `random.Random(task id)` from sorted lists, so a task id is the same task in every process;
- the recipe book is never modified (upstream's tree walk appends to its recipe lists, so what
  `craft` accepts drifts over resets);
- a task id out of range is an error (upstream wraps it), and so is a step after done;
- a count of more than 9 digits does not parse, so the command fails as an unparsable one does
  (upstream raises past 4300 digits, where Python 3.11+ refuses int()).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
from collections import Counter

from .base import Env, StepResult, TaskError
from .textcraft_world import (BOOK_PATH, SPLITS_PATH, Recipe, World, build_world,
                              load_builtin_world, read_datapack, read_recipe_book, to_id, to_name)

MAX_DISTRACTORS = 10  # upstream: at most 10 distractor commands, and 10 sampled uses per ingredient

# The command grammar (upstream's, compiled once). `match` anchors at the start only, like upstream.
# Counts have at most 9 digits: int() refuses more than 4300, and no game needs a billion items.
_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]{1,9}) (.*)")
_COUNT = re.compile(r"([0-9]{1,9}) (.*)")


# --------------------------------------------------------------------------------------------------
# Tasks and the expert
# --------------------------------------------------------------------------------------------------
def task_commands(world: World, idx: int, variant: int = 0) -> list[str]:
    """The crafting commands shown for task `idx`: its recipe tree plus distractors, shuffled.
    Variant k > 0 draws other distractors in another order for the same goal (training-data
    augmentation)."""
    rng = random.Random(idx if variant == 0 else f"{idx}/{variant}")
    tree, seen, stack = [], set(), [world.goals[idx]]
    # every recipe reachable from the goal through ingredients (tags: all their members)
    while stack:
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
    """Commands that craft `goal` from `inventory`: get the missing base items, then craft
    bottom-up."""
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


def listed_outputs(commands: list[str]) -> set[str]:
    """The item ids that the listed crafting commands make."""
    return {to_id(_COUNT.match(_CRAFT.match(c)[1])[2]) for c in commands}


def ingredient_kind(world: World, made: set[str], item: str) -> str:
    """`craft` where a listed command makes `item` (an item or tag id; a tag: one of its members),
    else `get`."""
    return "craft" if made.intersection(world.tag_members.get(item) or [item]) else "get"


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
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
            # Upstream prints the repr of its internal object here; kept verbatim, since agents
            # trained on upstream transcripts have seen exactly this text.
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
        """The first recipe of `out` whose ingredients are exactly `given` (a member matches its
        tag)."""
        item_tag = self.world.item_tag
        for recipe in self.world.item_recipes.get(out, ()):
            left = list(given)
            for ing in recipe.inputs:
                j = next((j for j, (item, _) in enumerate(left)
                          if (item_tag.get(item) == ing.name if ing.is_tag else item == ing.name)),
                         None)
                # the first match must have the right count
                if j is None or left[j][1] != ing.count:
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
        """The reasoning behind the expert's `action`: the recipes on the way from the goal down to
        the item it crafts or fetches, each as `<item> using <ingredients>` (the listed command
        without its leading `craft N`), e.g. `jungle button using 1 jungle planks; jungle planks
        using 1 jungle log`. `checked` adds after each recipe what each ingredient is, read off the
        listed commands: `craft` where one of them makes it (a tag: one of its members), else `get`,
        e.g. `jungle button using 1 jungle planks (jungle planks: craft); jungle planks using 1
        jungle log (jungle log: get)`."""
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
        made = listed_outputs(self.commands) if checked else set()

        # ` (a: craft, b: get)`: does a listed command make each ingredient?
        def marks(r: Recipe) -> str:
            if not checked:
                return ""
            return (" (" + ", ".join(f"{to_name(i.name)}: {ingredient_kind(w, made, i.name)}"
                                     for i in r.inputs) + ")")

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
            json.dump({"rule": "per depth: random.Random(0) shuffle, first 20% -> test",
                       **world.splits}, f)
            f.write("\n")
        print(f"wrote {SPLITS_PATH}: {len(world.splits['train'])} train, "
              f"{len(world.splits['test'])} test")
        return
    world = TextCraftEnv.load_world(args)
    by_depth = sorted(Counter(world.depth[g] for g in world.goals).items())
    print(f"{world.source}: {len(world.goals)} goals; goals by depth: {dict(by_depth)}")


if __name__ == "__main__":
    main()
