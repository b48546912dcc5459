"""The contract between the generic server (app.py) and one environment module.

An environment module defines a subclass of `Env`. The server holds one shared `world` per process
(loaded once by `Env.load_world`, read-only afterwards: recipe books, task lists) and creates one
`Env` per `/create`. The server serialises calls to one instance with a lock, so an `Env` needs no
locking of its own; it must never keep mutable state on the world.

Errors: raise `TaskError` for a caller's mistake (bad task id, action on a finished episode);
anything else that escapes is treated as a server bug (HTTP 500, logged).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


class TaskError(ValueError):
    """A caller's mistake inside an environment (HTTP 4xx); `status` picks the code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class StepResult:
    observation: str
    reward: float  # the reward of this step
    done: bool
    # the episode's score so far, where the game has one (BabyAI, SciWorld)
    score: float | None = None
    info: dict = field(default_factory=dict)


class Env:
    name = "base"
    # AgentGym's SearchQA dialect (app.py): a /create with no body or with a task `id` answers the
    # bare instance id, and a /reset naming the instance `env_idx` answers the bare first
    # observation.
    bare_answers = False

    # ---- world: shared, read-only, loaded once per server process ----
    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        """Add this environment's own command-line flags to `python -m env_server NAME`."""

    @classmethod
    def load_world(cls, args: argparse.Namespace | None = None):
        """Build the shared read-only data. `args` holds the flags of `add_args` (None:
        defaults)."""
        return None

    @classmethod
    def num_tasks(cls, world) -> int:
        """Task ids are 0 .. num_tasks-1; every process maps an id to the same task."""
        raise NotImplementedError

    @classmethod
    def splits(cls, world) -> dict[str, list[int]]:
        """Fixed train/test id lists shipped with the project: the lists in the world's `splits`
        (an attribute, or a key of a dict world); none: {}."""
        found = world.get("splits") if isinstance(world, dict) else getattr(world, "splits", None)
        return {k: list(v) for k, v in (found or {}).items() if isinstance(v, (list, tuple))}

    # ---- one instance ----
    def __init__(self, world):
        self.world = world

    def reset(self, idx: int) -> str:
        """Start task `idx`; return the first observation (raise TaskError(404) for a bad idx)."""
        raise NotImplementedError

    def reset_fields(self) -> dict:
        """Fields the /reset answer carries besides id, observation, reward, score and done (where a
        game's AgentGym server sends more, as SciWorld's task description)."""
        return {}

    def step(self, action: str) -> StepResult:
        """Apply one already-parsed action string."""
        raise NotImplementedError

    def observation(self) -> str:
        raise NotImplementedError

    def available_actions(self) -> list[str]:
        return []

    def detail(self) -> dict:
        """JSON-able description of the current state (goal, inventory, ...); also asked before the
        first reset, when there is no state yet."""
        return {}

    def expert_action(self) -> str | None:
        """The action an expert takes from the current state (None when it has none)."""
        return None

    def close(self) -> None:
        """Free resources (a JVM, a browser). Called once."""

    def abandon(self) -> None:
        """Called instead of close() when a call into this instance ran past the server's deadline,
        on another thread while that call may still be stuck: free what can be freed without waiting
        on it. Killing what the call waits on (a JVM) also frees its thread."""
        self.close()
