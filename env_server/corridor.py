"""Corridor: a two-action sanity-check game, the CartPole of this project.

The agent stands in a corridor; the goal is `distance` cells to its left or right. Each turn it
answers `left` or `right` (the last of those words in its reply counts; a reply with neither waits).
The observation tells where the goal is. Reward 1 on reaching the goal, 0 otherwise; done on
reaching it. A random policy wins sometimes, a good one always: small models learn it in minutes on
a CPU, which makes it the learning test of the training loop, not a benchmark.

Task id i: the goal is on the right when i is even. The training tasks (0-47) put it 1, 2 or 4 cells
away, the test tasks (48-59) 3 cells away: a game no training task plays, made of words the training
games use (an episode from 4 cells away reads "3 steps" on its way). Held-out success then measures
a policy that goes where the observation says, not one that remembers the training games.
"""

from __future__ import annotations

from .base import Env, StepResult, TaskError

NUM_TASKS, NUM_TRAIN = 60, 48


def distance(idx: int) -> int:
    return (1, 2, 4)[(idx // 2) % 3] if idx < NUM_TRAIN else 3


class CorridorEnv(Env):
    name = "corridor"

    @classmethod
    def num_tasks(cls, world) -> int:
        return NUM_TASKS

    @classmethod
    def splits(cls, world) -> dict[str, list[int]]:
        return {"train": list(range(NUM_TRAIN)), "test": list(range(NUM_TRAIN, NUM_TASKS))}

    @classmethod
    def task_category(cls, world, idx: int) -> str:
        return f"distance_{distance(idx)}"

    def __init__(self, world):
        super().__init__(world)
        self.goal: int | None = None  # None until the first reset

    def _require_task(self) -> None:
        if self.goal is None:
            raise TaskError("no task: call reset first", 409)

    def reset(self, idx: int) -> str:
        if not 0 <= idx < NUM_TASKS:
            raise TaskError(f"task id {idx} out of range 0..{NUM_TASKS - 1}", 404)
        self._place(idx)
        self.pos, self.done = 0, False
        return self.observation()

    def _place(self, idx: int) -> None:
        """Task idx's layout: here the goal."""
        self.goal = distance(idx) * (1 if idx % 2 == 0 else -1)

    def observation(self) -> str:
        self._require_task()
        gap = self.goal - self.pos
        if gap == 0:
            return "You reached the goal."
        return (f"The goal is {abs(gap)} step{'s' if abs(gap) > 1 else ''} to your "
                f"{'right' if gap > 0 else 'left'}.")

    def step(self, action: str) -> StepResult:
        self._require_task()
        if self.done:
            raise TaskError("the episode is over", 409)
        words = [w for w in action.lower().replace(",", " ").replace(".", " ").split()
                 if w in ("left", "right")]
        if words:
            self.pos += 1 if words[-1] == "right" else -1
        self.done = self.pos == self.goal
        return StepResult(self.observation(), 1.0 if self.done else 0.0, self.done)

    def available_actions(self) -> list[str]:
        return ["left", "right"]

    def detail(self) -> dict:
        if self.goal is None:
            return {"goal": None, "position": None}
        return {"goal": self.goal, "position": self.pos}

    def expert_action(self) -> str | None:
        return (None if self.goal is None or self.done
                else ("right" if self.goal > self.pos else "left"))
