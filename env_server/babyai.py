"""BabyAI as a text game: minigrid's BabyAI levels behind high-level text actions.

Follows AgentGym's agentenv-babyai, the BabyAI server AgentGym-RL trains on:
- task id i -> level LEVELS[i % 40] (the original's 1-based `i % 40 + 1`), seed i // 40;
- the agent reads its 7x7 egocentric view as text, character for character as the original writes it
  (but for the departures below): "Your goal: <mission>", a newline, then the view. A view holding
  any object or wall reads "In front of you in this room, you can see several objects: ", then each
  door, key, ball or box, nearest first, as "There is a red ball 1 2 steps in front of you and 1
  steps to your left." (or "... right in front of you 3 steps away.") followed by TWO spaces; a view
  holding only walls lists none, so its colon is followed directly by the next sentence. A view
  holding nothing at all reads "You cannot see any objects within sight." with no space after it
  (the original's spacing). Then, one space apart: "The room has walls around you.", "You are facing
  a wall 3 steps away." (the nearest wall or box straight ahead, where one is in view) and "You are
  carrying a grey key." or "You are not carrying anything."; then a newline and `Available actions:
  ["turn left", ...]`. E.g. `In front of you in this room, you can see several objects: There is a
  grey ball 1 1 steps in front of you and 1 steps to your left.  The room has walls around you. You
  are not carrying anything.` A step's observation is the same view without the goal line (or the
  step's message: an error, the action list), then the actions line;
- actions are turn/move primitives plus "go to <obj> <n>", "pickup <obj> <n>", "go through <door>
  <n>", "toggle and go through <door> <n>", "toggle", "drop" and "check available actions"; the
  high-level ones run as a shortest path over (cell, direction) states, found by BFS;
- reward is minigrid's `1 - 0.9 * step_count / max_steps` on success, 0 otherwise.

Deliberate departures from the original (its behaviour in brackets):
- BabyAI-GoToObjS6-v1 stands for -v0, which minigrid >= 2.5 no longer registers.
- The goal is minigrid's mission verbatim ["then"/"after you" were rewritten to "and", losing the
  order].
- Paths run over every cell seen this episode [the current view only, with unseen cells taken as
  free].
- "<obj> <n>" in an action is the n-th <obj> of the description [only reachable objects were
  counted].
- "move forward" is offered exactly when the front cell can be entered [also into balls and doors].
- "toggle" is also offered facing a box (opens it, as in minigrid; KeyInBox needs it) or an open
  door (closes it; a mission may ask to open a door that is already open) [closed or locked doors
  only].
- "pick up" is accepted for "pickup", as AgentGym's prompt spells it [only "pickup"].
- A plan stops at the low-level step that ends the episode [it kept stepping after success].
- done = minigrid terminated or truncated [done stayed False when the reward was <= 0.5]; a failed
  episode says so [nothing was said].
- The view is read off the grid: the first view of PutNextS7N4Carrying does not list the object the
  agent starts out carrying at the cell it was taken from [minigrid's first observation is made
  before the level hands the object over, so it was listed there too, and "go to" it was offered].
- OpenDoorsOrderN4Debug's two-door missions check the second door from the action after the first
  door opened [minigrid checks that toggle against the second part too, strictly, and fails it:
  these missions, 4 in 5 of the level's tasks, could not be won; minigrid's own bot won none
  (babyai_mends.py)].
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections import deque
from pathlib import Path

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI-* environments with gymnasium)
import numpy as np

from .babyai_expert import DIR_VEC, DROP, FORWARD, LEFT, PICKUP, RIGHT, TOGGLE, Expert
from .babyai_mends import mend_order
from .base import Env, StepResult, TaskError

# The original's level list, in its order (its `all_levels[1..40]`).
LEVELS = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1", "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0",
    "BabyAI-GoToImpUnlock-v0", "BabyAI-GoToSeqS5R2-v0", "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0", "BabyAI-Open-v0", "BabyAI-OpenRedDoor-v0",
    "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0", "BabyAI-OpenDoorsOrderN4Debug-v0",
    "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0",
    "BabyAI-KeyInBox-v0", "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0",
    "BabyAI-UnlockToUnlock-v0", "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0",
    "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0", "BabyAI-MoveTwoAcrossS8N9-v0",
    "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)
SEEDS_PER_LEVEL = 1000  # the original takes any id; bounded seeds make ids a finite range
SPLITS_FILE = Path(__file__).parent / "data" / "babyai_splits.json"

DESCRIBED = ("door", "key", "ball", "box")  # what BabyAI levels contain, walls aside
UNKNOWN_ACTION = "The action is not recognized. Please check valid actions."
NO_CHANGE = "No change in state."
SUCCESS_SUFFIX = "\n The task is completed."
FAILURE_SUFFIX = "\n The task is not completed, and the episode is over."


def level_and_seed(idx: int) -> tuple[str, int]:
    """Task id -> (gymnasium level id, reset seed), as the original maps `data_idx`."""
    return LEVELS[idx % len(LEVELS)], idx // len(LEVELS)


def obj_name(obj) -> str:
    """'red ball', or 'red closed door' for doors (the state is part of the name, as upstream)."""
    if obj.type == "door":
        state = "open" if obj.is_open else "locked" if obj.is_locked else "closed"
        return f"{obj.color} {state} door"
    return f"{obj.color} {obj.type}"


def normalize(action: str) -> str:
    """Lower-case, single spaces, no surrounding quotes or final period; 'pick up' = 'pickup'."""
    text = " ".join(action.lower().split()).strip("\"'`").rstrip(".").strip()
    return re.sub(r"^pick up\b", "pickup", text)


class BabyAIEnv(Expert, Env):
    name = "babyai"

    # ---- world: the level list and the shipped splits ----
    @classmethod
    def load_world(cls, args=None):
        return {"levels": LEVELS, "splits": json.loads(SPLITS_FILE.read_text())}

    @classmethod
    def num_tasks(cls, world) -> int:
        return len(LEVELS) * SEEDS_PER_LEVEL

    @classmethod
    def task_category(cls, world, idx: int) -> str:
        return level_and_seed(idx)[0]

    # ---- one episode ----
    def __init__(self, world):
        super().__init__(world)
        self._env = None  # the minigrid level, unwrapped: no env checker, never rendered

    def reset(self, idx: int) -> str:
        n = self.num_tasks(self.world)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            raise TaskError(f"data_idx must be an integer in [0, {n}), got {idx!r}", 404)
        self.idx = idx
        self.level, self.seed = level_and_seed(idx)
        self._env = gym.make(self.level, disable_env_checker=True).unwrapped
        with contextlib.redirect_stdout(io.StringIO()):  # minigrid prints every layout it rejects
            obs, _ = self._env.reset(seed=self.seed)
        mend_order(self._env.instrs)
        self._seen = np.zeros((self._env.width, self._env.height), dtype=bool)  # cells seen so far
        self._skipped = np.zeros_like(self._seen)  # cells the expert's bot saw, the agent did not
        self._carried = None  # the expert's bot, kept between calls (see expert_action)
        self._expert_memo = (None, None)  # (turn, answer) of the last expert call
        self._unlocking = None  # the locked door the expert opens where its bot failed (_unlock)
        self._turns, self._score = 0, 0.0
        self._done = self._success = False
        self._observe(obs)
        return self.observation()

    def _observe(self, obs) -> None:
        """Take minigrid's new view: mark the visible cells as seen, drop the cached analysis."""
        # (7, 7, 3): columns left -> right, rows far -> near; type 0 = unseen
        self._image = obs["image"]
        self._info = None
        self._seen[tuple(self._env.agent_pos)] = True
        for *_, (x, y) in self._visible_cells():
            self._seen[x, y] = True

    def _require_task(self) -> None:
        if self._env is None:
            raise TaskError("no task yet: call reset first", 409)

    # ---- what the agent reads ----
    def observation(self) -> str:
        """The current state in full (goal, view, actions), whatever the last step returned."""
        self._require_task()
        return f"Your goal: {self._env.mission}\n{self._describe()}{self._actions_line()}"

    def available_actions(self) -> list[str]:
        self._require_task()
        return list(self._analyse()["actions"])

    def detail(self) -> dict:
        if self._env is None:
            return {"task_id": None, "done": False}
        env = self._env
        return {
            "task_id": self.idx, "level": self.level, "seed": self.seed, "mission": env.mission,
            "position": [int(v) for v in env.agent_pos], "direction": int(env.agent_dir),
            "carrying": obj_name(env.carrying) if env.carrying else None,
            "done": self._done, "success": self._success, "score": self._score,
            "steps": self._turns, "env_steps": int(env.step_count),
            "max_env_steps": int(env.max_steps),
        }

    def _actions_line(self) -> str:
        listed = ", ".join(f'"{a}"' for a in self._analyse()["actions"])
        return "\nAvailable actions: [" + listed + "]"

    def _describe(self) -> str:
        """The view as the original words it (see the module docstring): each object's sentence is
        followed by two spaces, the other sentences by one; a view with walls but no object opens
        the object list and lists nothing; "...within sight." is followed by no space at all."""
        info = self._analyse()
        if info["objects"] or info["walls"]:
            text = "In front of you in this room, you can see several objects: "
            for name, n, front, right, _, _ in info["objects"]:
                if right == 0:
                    where = f"right in front of you {front} steps away"
                else:
                    side = "right" if right > 0 else "left"
                    where = f"{front} steps in front of you and {abs(right)} steps to your {side}"
                text += f"There is a {name} {n} {where}.  "
        else:
            text = "You cannot see any objects within sight."
        text += "The room has walls around you. "
        if info["barrier"]:
            text += "You are facing a {} {} steps away. ".format(*info["barrier"])
        held = self._env.carrying
        return text + (f"You are carrying a {held.color} {held.type}." if held
                       else "You are not carrying anything.")

    def _visible_cells(self) -> list[tuple]:
        """(distance, row, column, front, right, (x, y)) of each visible cell but the agent's,
        nearest first."""
        env, view = self._env, self._image.shape[0]
        (fx, fy), (rx, ry) = DIR_VEC[env.agent_dir], DIR_VEC[(env.agent_dir + 1) % 4]
        cells = []
        for j in range(view):
            for i in range(view):
                front, right = view - 1 - j, i - view // 2
                x = env.agent_pos[0] + fx * front + rx * right
                y = env.agent_pos[1] + fy * front + ry * right
                inside = 0 <= x < env.width and 0 <= y < env.height
                if self._image[i, j, 0] and (front, right) != (0, 0) and inside:
                    cells.append((front + abs(right), j, i, front, right, (int(x), int(y))))
        return sorted(cells)  # ties in the original's scan order: far rows first, left to right

    def _analyse(self) -> dict:
        """Objects in view (name, number, front, right, pos, obj), whether a wall is in view, the
        barrier ahead, and each text action with its low-level plan; error messages for actions that
        exist but cannot run. Cached."""
        if self._info is None:
            objects, counts, barrier, walls = [], {}, None, False
            for _, _, _, front, right, pos in self._visible_cells():
                obj = self._env.grid.get(*pos)
                walls = walls or (obj is not None and obj.type == "wall")
                if (obj is not None and right == 0 and obj.type in ("wall", "box")
                        and barrier is None):
                    barrier = (obj.type, front)
                if obj is not None and obj.type in DESCRIBED:
                    counts[obj_name(obj)] = counts.get(obj_name(obj), 0) + 1
                    objects.append((obj_name(obj), counts[obj_name(obj)], front, right, pos, obj))
            actions, errors = self._plans(objects)
            self._info = {"objects": objects, "walls": walls, "barrier": barrier,
                          "actions": actions, "errors": errors}
        return self._info

    def _plans(self, objects) -> tuple[dict, dict]:
        """Text actions -> low-level plans, in the original's order, and the errors of impossible
        ones."""
        env, parents = self._env, self._bfs()
        held = env.carrying
        fx, fy = env.front_pos
        front = env.grid.get(fx, fy) if 0 <= fx < env.width and 0 <= fy < env.height else None
        actions, errors = {"turn left": [LEFT], "turn right": [RIGHT]}, {}
        if front is None or front.can_overlap():
            actions["move forward"] = [FORWARD]
        else:
            errors["move forward"] = "There is a barrier in front of you, you can't move forward."
        for name, n, _, _, pos, obj in objects:
            if obj.type in ("key", "ball", "box"):
                path, label = self._path_facing(parents, pos), f"pickup {name} {n}"
                if held:
                    errors[label] = (f"You cannot pickup {name} {n}, as you are already carrying "
                                     "something.")
                elif path is None:
                    errors[label] = (f"You cannot pickup {name} {n}, as there is no path leading "
                                     "to it.")
                else:
                    actions[label] = path + [PICKUP]
        if held and front is None:
            actions["drop"] = [DROP]
        else:
            errors["drop"] = ("You cannot drop the object, as "
                              + ("there is already an object in front of you." if held
                                 else "you are not carrying anything."))
        if front is not None and (front.type == "box" or front.type == "door" and front.is_open):
            actions["toggle"] = [TOGGLE]  # open the box, close the door (closed doors come below)
        for name, n, _, _, pos, door in objects:
            if door.type != "door":
                continue
            through, toggle_through = f"go through {name} {n}", f"toggle and go through {name} {n}"
            cannot = f"You cannot toggle and go through {name} {n}, as"
            if door.is_open:
                path = self._path_onto(parents, pos)
                if path is None:
                    errors[through] = (f"You cannot go through {name} {n}, as there is no path "
                                       "leading to it.")
                else:
                    actions[through] = path
                continue
            state = name.split()[1]
            errors[through] = (f"You cannot go through {name} {n}, as it is {state}. You should "
                               "toggle it first.")
            path = self._path_facing(parents, pos)
            if door.is_locked and (held is None or held.type != "key"):
                errors[toggle_through] = f"{cannot} you are not carrying a key."
            elif door.is_locked and held.color != door.color:
                errors[toggle_through] = (f"{cannot} the color of the key you are carrying "
                                          "does not match the color of door.")
            elif path is None:
                errors[toggle_through] = f"{cannot} there is no path leading to it."
            else:
                actions[toggle_through] = path + [TOGGLE, FORWARD]
                if not path:
                    actions["toggle"] = [TOGGLE]
        for name, n, _, _, pos, _ in objects:
            path = self._path_facing(parents, pos)
            if path is None:
                errors[f"go to {name} {n}"] = (f"You cannot go to {name} {n}, as there is no path "
                                               "leading to it.")
            else:
                actions[f"go to {name} {n}"] = path
        actions["check available actions"] = []
        return actions, errors

    # ---- path planning: BFS over (x, y, dir) states through the cells seen this episode ----
    def _bfs(self, known=None) -> dict:
        """{state: (previous state, action)} for every state reachable from the agent's (None for
        it), through `known` cells (default: those seen)."""
        env, known = self._env, self._seen if known is None else known
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        parents, queue = {start: None}, deque([start])
        while queue:
            x, y, d = state = queue.popleft()
            ahead = (x + DIR_VEC[d][0], y + DIR_VEC[d][1], d)
            # Forward first, so that of equally short paths the straighter one wins.
            for nxt, action in ((ahead, FORWARD), ((x, y, (d - 1) % 4), LEFT),
                                ((x, y, (d + 1) % 4), RIGHT)):
                if nxt in parents:
                    continue
                if action == FORWARD:
                    nx, ny, _ = nxt
                    if not (0 <= nx < env.width and 0 <= ny < env.height and known[nx, ny]):
                        continue
                    obj = env.grid.get(nx, ny)
                    if obj is not None and not obj.can_overlap():
                        continue
                parents[nxt] = (state, action)
                queue.append(nxt)
        return parents

    @staticmethod
    def _shortest(parents: dict, goals) -> list[int] | None:
        """The shortest plan reaching any of the `goals` states."""
        best = None
        for state in goals:
            if state not in parents:
                continue
            path = []
            while parents[state] is not None:
                state, action = parents[state]
                path.append(action)
            if best is None or len(path) < len(best):
                best = path[::-1]
        return best

    def _path_facing(self, parents: dict, pos) -> list[int] | None:
        """Shortest plan that ends next to `pos`, facing it."""
        return self._shortest(parents, [(pos[0] - dx, pos[1] - dy, d)
                                        for d, (dx, dy) in enumerate(DIR_VEC)])

    def _path_onto(self, parents: dict, pos) -> list[int] | None:
        """Shortest plan that ends standing on `pos` (an open door)."""
        return self._shortest(parents, [(pos[0], pos[1], d) for d in range(4)])

    # ---- acting ----
    def step(self, action: str) -> StepResult:
        """Every call is a turn, valid or not; an invalid action leaves minigrid untouched."""
        self._require_task()
        if self._done:
            raise TaskError("the episode is over: reset the environment first", 409)
        text, info = normalize(action), self._analyse()
        self._turns += 1
        reward, valid = 0.0, True
        if "check" in text:  # as upstream: any action mentioning "check" lists the actions
            observation = "You can take the following actions: " + ", ".join(info["actions"])
        elif text not in info["actions"]:
            valid = False
            observation = info["errors"].get(text, UNKNOWN_ACTION) if text else NO_CHANGE
        elif not info["actions"][text]:  # e.g. "go to" the object already faced
            observation = NO_CHANGE
        else:
            reward = self._execute(info["actions"][text])
            observation = self._describe()
            if self._done:
                observation += SUCCESS_SUFFIX if self._success else FAILURE_SUFFIX
        return StepResult(observation + self._actions_line(), reward, self._done, self._score,
                          {"action_valid": valid, "env_steps": int(self._env.step_count)})

    def _execute(self, plan: list[int]) -> float:
        """Run low-level actions until the plan or the episode ends; return the reward."""
        for low in plan:
            obs, reward, terminated, truncated, _ = self._env.step(low)
            self._observe(obs)
            if terminated or truncated:
                self._done, self._success, self._score = True, reward > 0, float(reward)
                return float(reward)
        return 0.0

    def close(self) -> None:
        self._env = self._carried = None
