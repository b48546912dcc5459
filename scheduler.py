"""Turn-horizon schedules: how many assistant turns (rounds) a trajectory may take at step s.

ScalingInter-RL (Xi et al. 2025, "AgentGym-RL", arXiv 2509.08755) starts with a short horizon,
so the agent first learns to solve tasks in few turns, and lengthens it in stages, so it then
learns to use longer interaction (planning, reflection) without the collapse seen with long
fixed horizons.

Every schedule answers `max_turns(step)` for a step counted from 1, and `stage(step)` for the
index of the stage that step falls in. Its whole state is in `state_dict()`, so a run resumed
from a checkpoint continues exactly where it stopped. Upstream's StepRoundsScheduler counted
calls internally and came back one step off after a resume; here the step is always passed in
explicitly, and schedules that learn from training (`observe`) record the last step they
observed and refuse to see it twice.

- FixedHorizon(turns): the same horizon at every step.
- StepwiseHorizon(rounds, every): ScalingInter-RL; step s uses
  rounds[min((s-1) // every, len-1)].
- `SCHEDULES` / `register_schedule`: the --schedule-kind registry; trainer/plateau.py adds
  "plateau" (not in the paper: the next horizon once the success rate has stopped improving).

Rounds need not increase: a shrinking horizon is a legitimate ablation, so any list of
positive integers is accepted. Zero or negative turns are rejected.
"""

from __future__ import annotations

import re


class HorizonSchedule:
    """Base interface. Subclasses implement `stage`, `max_turns`, `describe` and their
    config/state (`_config`, and `state_dict` where they learn from training)."""

    kind = "base"

    def stage(self, step: int) -> int:
        raise NotImplementedError

    def max_turns(self, step: int) -> int:
        raise NotImplementedError

    def observe(self, step: int, success_rate: float) -> None:
        """Feed the success rate measured at `step`; schedules that do not adapt ignore it."""

    def describe(self) -> str:
        raise NotImplementedError

    def _config(self) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"kind": self.kind, **self._config()}

    def load_state_dict(self, d: dict) -> None:
        # A checkpoint of another schedule would silently change the experiment: refuse it
        mine = self.state_dict()
        theirs = {k: d.get(k) for k in ("kind", *self._config())}
        if theirs != {k: mine[k] for k in theirs}:
            raise ValueError(f"checkpoint schedule {theirs} does not match this run's "
                             f"{self._config()} ({self.describe()}); "
                             "resume with the same --schedule and --schedule-every")


def check_step(step: int) -> int:
    """`step` as an int, refused unless it counts from 1 (checked by every schedule)."""
    if int(step) != step or step < 1:
        raise ValueError(f"training steps count from 1, got {step!r}")
    return int(step)


def check_rounds(rounds) -> list[int]:
    """The horizons as ints, refused unless all are positive (each schedule's __init__)."""
    rounds = [int(r) for r in rounds]
    if not rounds or any(r < 1 for r in rounds):
        raise ValueError(f"--schedule: turns must be positive integers, got {rounds}")
    return rounds


class FixedHorizon(HorizonSchedule):
    """The same horizon K at every step (the paper's fixed-turn baselines)."""

    kind = "fixed"

    def __init__(self, turns: int):
        self.turns = check_rounds([turns])[0]

    def stage(self, step: int) -> int:
        check_step(step)
        return 0

    def max_turns(self, step: int) -> int:
        check_step(step)
        return self.turns

    def describe(self) -> str:
        return f"fixed horizon: {self.turns} turns"

    def _config(self) -> dict:
        return {"turns": self.turns}


class StepwiseHorizon(HorizonSchedule):
    """ScalingInter-RL: stage k = min((s-1) // every, len(rounds)-1) covers steps k*every+1 ..
    (k+1)*every and uses rounds[k]; the last stage lasts to the end of training.
    E.g. rounds [10, 20, 30], every 100: steps 1-100 -> 10, 101-200 -> 20, 201+ -> 30."""

    kind = "stepwise"

    def __init__(self, rounds: list[int], every: int):
        self.rounds = check_rounds(rounds)
        if int(every) < 1:
            raise ValueError("--schedule-every must be a positive number of steps, "
                             f"got {every}")
        self.every = int(every)

    def stage(self, step: int) -> int:
        return min((check_step(step) - 1) // self.every, len(self.rounds) - 1)

    def max_turns(self, step: int) -> int:
        return self.rounds[self.stage(step)]

    def describe(self) -> str:
        stages = " -> ".join(map(str, self.rounds))
        return f"ScalingInter-RL: {stages} turns, every {self.every} steps"

    def _config(self) -> dict:
        return {"rounds": list(self.rounds), "every": self.every}


_SPEC_RE = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*")

# --schedule-kind NAME: a factory (rounds, every, **kw) -> HorizonSchedule for a list of two
# or more horizons (a single horizon is always FixedHorizon). `register_schedule` adds one
# from anywhere (trainer/plateau.py adds "plateau" when imported).
SCHEDULES: dict = {}


def register_schedule(kind: str):
    def add(factory):
        SCHEDULES[kind] = factory
        return factory
    return add


@register_schedule("step")
def _stepwise(rounds: list[int], every: int, **kw) -> HorizonSchedule:
    if kw:
        raise ValueError(f"a stepwise schedule takes no {sorted(kw)}")
    return StepwiseHorizon(rounds, every)


def horizons(spec: str) -> list[int]:
    """The horizons of `--schedule` ("15" or "10,20,30"): the one place it is parsed."""
    text = str(spec)
    if not _SPEC_RE.fullmatch(text):
        raise ValueError(f"--schedule must be a positive integer (fixed horizon) or a "
                         f"comma-separated list of them, e.g. 10,20,30; got {text!r}")
    return check_rounds(text.split(","))


def stage_steps(spec: str, steps: int, every: int | None = None) -> int:
    """Steps per horizon stage: `every` (--schedule-every), else `steps` shared evenly by the
    stages."""
    return every or max(1, -(-steps // len(horizons(spec))))


def make_schedule(spec: str, every: int = 100, kind: str = "step", **kw) -> HorizonSchedule:
    """Build a schedule from the CLI: `--schedule 15` is a fixed horizon,
    `--schedule 10,20,30` a staged one of kind `kind` (SCHEDULES): "step" advances every
    `every` steps (ScalingInter-RL); a registered kind takes its own options as `**kw`
    (trainer/plateau.py's "plateau": patience, min_delta, window)."""
    rounds = horizons(spec)
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r}; "
                         f"registered: {', '.join(sorted(SCHEDULES))}")
    if len(rounds) == 1:
        return FixedHorizon(rounds[0])
    return SCHEDULES[kind](rounds, every, **kw)


def stage_bounds(schedule: HorizonSchedule, total_steps: int) -> list[tuple[int, int, int]]:
    """(first step, last step, turns) of each stage within steps 1..total_steps, both ends
    inclusive, for plots that shade the stages. For a schedule that adapts to training
    (trainer/plateau.py) it reflects the stages observed so far."""
    bounds: list[tuple[int, int, int]] = []
    for step in range(1, total_steps + 1):
        if bounds and schedule.stage(step) == schedule.stage(bounds[-1][0]):
            bounds[-1] = (bounds[-1][0], step, bounds[-1][2])
        else:
            bounds.append((step, step, schedule.max_turns(step)))
    return bounds
