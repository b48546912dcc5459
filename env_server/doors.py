"""Doors: Corridor with a closed door on the way to some goals, built to test the turn horizon.

As in Corridor the goal is `distance` cells away and each turn moves one cell ("left", "right";
the last of the game's words in a reply counts). A closed door in the way stops the walker until
it answers "open" beside it; "open" anywhere else, a reply with none of the words, and a step
back each waste a turn. The observation names the goal's distance and, beside a closed door, the
door. Reward 1 on reaching the goal, 0 otherwise.

The doors stand 2 or more cells away, so a door is first seen after a move, and a goal behind
one takes its distance plus one turn. With a horizon of 2 turns no door task can ever be won:
the skill of opening is rewarded only in longer episodes, which is the short horizon's ceiling
that the horizon study measures (docs/plan_horizons.md).

The goal is always on the right: the game asks for no reading of a direction, only for walking
on and for opening a door when one is met. Tasks, (distance, door) in turn: training 0-47 (1, -),
(2, -), (4, -), (2, 2), (4, 2), (4, 4); test 48-59 (3, -), (3, 2), (3, 3): a distance no training
task plays, behind doors where training tasks have theirs (2 cells away, or at the goal).
"""

from __future__ import annotations

from .base import StepResult, TaskError
from .corridor import NUM_TRAIN, CorridorEnv  # Corridor's split: 48 training tasks, 12 test

TRAIN_KINDS = ((1, None), (2, None), (4, None), (2, 2), (4, 2), (4, 4))
TEST_KINDS = ((3, None), (3, 2), (3, 3))
WORDS = ("left", "right", "open")


def kind(idx: int) -> tuple[int, int | None]:
    """(distance, the door's distance or None) of task idx."""
    if idx < NUM_TRAIN:
        return TRAIN_KINDS[idx % len(TRAIN_KINDS)]
    return TEST_KINDS[(idx - NUM_TRAIN) % len(TEST_KINDS)]


class DoorsEnv(CorridorEnv):
    name = "doors"

    @classmethod
    def task_category(cls, world, idx: int) -> str:
        d, door = kind(idx)
        return f"distance_{d}" + (f"_door_{door}" if door else "")

    def _place(self, idx: int) -> None:
        self.goal, self.door = kind(idx)

    def _door_beside(self) -> int:
        """+1 or -1 where a closed door stands next to the walker, else 0."""
        if self.door is not None and abs(self.door - self.pos) == 1:
            return self.door - self.pos
        return 0

    def observation(self) -> str:
        text = super().observation()
        side = self._door_beside()
        return text + (f" A closed door is on your {'right' if side > 0 else 'left'}."
                       if side and not self.done else "")

    def step(self, action: str) -> StepResult:
        self._require_task()
        if self.done:
            raise TaskError("the episode is over", 409)
        words = [w for w in action.lower().replace(",", " ").replace(".", " ").split()
                 if w in WORDS]
        move = {"right": 1, "left": -1}.get(words[-1], 0) if words else 0
        if words and words[-1] == "open" and self._door_beside():
            self.door = None
        elif move and self.pos + move != self.door:
            self.pos += move
        self.done = self.pos == self.goal
        return StepResult(self.observation(), 1.0 if self.done else 0.0, self.done)

    def available_actions(self) -> list[str]:
        return list(WORDS)

    def detail(self) -> dict:
        return {**super().detail(), "door": getattr(self, "door", None)}

    def expert_action(self) -> str | None:
        if self.goal is None or self.done:
            return None
        toward = 1 if self.goal > self.pos else -1
        return "open" if self._door_beside() == toward else ("right" if toward > 0 else "left")
