"""Turn-horizon schedules: how many assistant turns (rounds) a trajectory may take at training step s.

ScalingInter-RL (Xi et al. 2025, "AgentGym-RL", arXiv 2509.08755) starts with a short horizon, so the
agent first learns to solve tasks in few turns, and lengthens it in stages, so it then learns to use
longer interaction (planning, reflection) without the collapse seen with long fixed horizons.

Every schedule answers `max_turns(step)` for a step counted from 1, and `stage(step)` for the index of
the stage that step falls in. Its whole state is in `state_dict()`, so a run resumed from a checkpoint
continues exactly where it stopped. Upstream's StepRoundsScheduler counted calls internally and came
back one step off after a resume; here the step is always passed in explicitly, and schedules that
learn from training (PlateauHorizon) record the last step they observed and refuse to see it twice.

- FixedHorizon(turns): the same horizon at every step.
- StepwiseHorizon(rounds, every): ScalingInter-RL; step s uses rounds[min((s-1) // every, len-1)].
- PlateauHorizon(rounds, patience, min_delta, window): not in the paper; moves to the next horizon
  when the moving-average success rate has stopped improving, instead of at fixed steps.

Rounds need not increase: a shrinking horizon is a legitimate ablation, so any list of positive
integers is accepted. Zero or negative turns are rejected.
"""

from __future__ import annotations

import math
import re


class HorizonSchedule:
    """Base interface. Subclasses implement `stage`, `max_turns`, `describe` and their config/state."""

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
        # A checkpoint made under another schedule would silently change the experiment: refuse it.
        mine = self.state_dict()
        theirs = {k: d.get(k) for k in ("kind", *self._config())}
        if theirs != {k: mine[k] for k in theirs}:
            raise ValueError(f"checkpoint schedule {theirs} does not match this run's {self._config()} "
                             f"({self.describe()}); resume with the same --schedule")


def _check_step(step: int) -> int:
    if int(step) != step or step < 1:
        raise ValueError(f"training steps count from 1, got {step!r}")
    return int(step)


def _check_rounds(rounds) -> list[int]:
    rounds = [int(r) for r in rounds]
    if not rounds or any(r < 1 for r in rounds):
        raise ValueError(f"--schedule: turns must be positive integers, got {rounds}")
    return rounds


class FixedHorizon(HorizonSchedule):
    """The same horizon K at every step (the paper's fixed-turn baselines)."""

    kind = "fixed"

    def __init__(self, turns: int):
        self.turns = _check_rounds([turns])[0]

    def stage(self, step: int) -> int:
        _check_step(step)
        return 0

    def max_turns(self, step: int) -> int:
        _check_step(step)
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
        self.rounds = _check_rounds(rounds)
        if int(every) < 1:
            raise ValueError(f"--schedule-every must be a positive number of steps, got {every}")
        self.every = int(every)

    def stage(self, step: int) -> int:
        return min((_check_step(step) - 1) // self.every, len(self.rounds) - 1)

    def max_turns(self, step: int) -> int:
        return self.rounds[self.stage(step)]

    def describe(self) -> str:
        return f"ScalingInter-RL: {' -> '.join(map(str, self.rounds))} turns, every {self.every} steps"

    def _config(self) -> dict:
        return {"rounds": list(self.rounds), "every": self.every}


class PlateauHorizon(HorizonSchedule):
    """Advance to the next horizon when the success rate has plateaued at the current one.

    After each step, `observe(step, success_rate)` appends the rate to the stage's history. Once the
    stage has `window` observations, the moving average of the last `window` rates is compared with the
    best moving average of this stage: more than `min_delta` above it is an improvement (the best is
    updated, the stall counter reset); otherwise the stall counter grows. When it reaches `patience`,
    the next horizon starts at the following step, with a fresh history and best. So a stage lasts at
    least window + patience steps. The last horizon is kept to the end.
    `stage(step)` is exact for past steps as well (stage start steps are recorded), so stage_bounds works.
    """

    kind = "plateau"

    def __init__(self, rounds: list[int], patience: int = 20, min_delta: float = 0.01, window: int = 10):
        self.rounds = _check_rounds(rounds)
        if int(patience) < 1 or int(window) < 1 or min_delta < 0:
            raise ValueError(f"plateau schedule needs patience >= 1, window >= 1, min_delta >= 0; "
                             f"got {patience}, {window}, {min_delta}")
        self.patience, self.min_delta, self.window = int(patience), float(min_delta), int(window)
        self.stage_starts = [1]  # step at which each stage began; len - 1 is the current stage
        self.best: float | None = None  # best moving average in the current stage
        self.stall = 0  # observations since the last improvement, once the window is full
        self.history: list[float] = []  # the current stage's last `window` success rates
        self.last_step = 0  # last step observed; observing it (or an earlier one) again is a bug

    def stage(self, step: int) -> int:
        _check_step(step)
        return sum(start <= step for start in self.stage_starts) - 1

    def max_turns(self, step: int) -> int:
        return self.rounds[self.stage(step)]

    def observe(self, step: int, success_rate: float) -> None:
        step = _check_step(step)
        if step <= self.last_step:
            raise ValueError(f"step {step} observed after step {self.last_step}; each step is observed "
                             "once, in order (a resumed run must start at the checkpoint's step + 1)")
        self.last_step = step
        self.history = (self.history + [float(success_rate)])[-self.window:]
        if len(self.history) < self.window:
            return
        moving_avg = sum(self.history) / self.window
        if self.best is None or moving_avg > self.best + self.min_delta:
            self.best, self.stall = moving_avg, 0
            return
        self.stall += 1
        if self.stall >= self.patience and len(self.stage_starts) < len(self.rounds):
            self.stage_starts.append(step + 1)
            self.best, self.stall, self.history = None, 0, []

    def describe(self) -> str:
        return (f"plateau: {' -> '.join(map(str, self.rounds))} turns; next horizon after {self.patience} "
                f"steps without +{self.min_delta} on the {self.window}-step mean success rate "
                f"(now stage {len(self.stage_starts) - 1})")

    def _config(self) -> dict:
        return {"rounds": list(self.rounds), "patience": self.patience, "min_delta": self.min_delta,
                "window": self.window}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stage_starts": list(self.stage_starts), "best": self.best,
                "stall": self.stall, "history": list(self.history), "last_step": self.last_step}

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        self.stage_starts = [int(s) for s in d["stage_starts"]]
        self.best = None if d["best"] is None else float(d["best"])
        self.stall, self.last_step = int(d["stall"]), int(d["last_step"])
        self.history = [float(x) for x in d["history"]]


_SPEC_RE = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*")

# --schedule-kind NAME: a factory (rounds, every, **kw) -> HorizonSchedule for a list of two or more
# horizons (a single horizon is always FixedHorizon). `register_schedule` adds one from anywhere.
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


@register_schedule("plateau")
def _plateau(rounds: list[int], every: int, **kw) -> HorizonSchedule:
    return PlateauHorizon(rounds, **kw)


def make_schedule(spec: str, every: int = 100, kind: str = "step", **kw) -> HorizonSchedule:
    """Build a schedule from the CLI: `--schedule 15` is a fixed horizon, `--schedule 10,20,30` a staged
    one of kind `kind` (SCHEDULES): "step" advances every `every` steps (ScalingInter-RL), "plateau" when
    the success rate plateaus (`**kw`: patience, min_delta, window)."""
    text = str(spec)
    if not _SPEC_RE.fullmatch(text):
        raise ValueError(f"--schedule must be a positive integer (fixed horizon) or a comma-separated "
                         f"list of them, e.g. 10,20,30; got {text!r}")
    rounds = _check_rounds(text.split(","))
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r}; registered: {', '.join(sorted(SCHEDULES))}")
    if len(rounds) == 1:
        return FixedHorizon(rounds[0])
    return SCHEDULES[kind](rounds, every, **kw)


def stage_bounds(schedule: HorizonSchedule, total_steps: int) -> list[tuple[int, int, int]]:
    """(first step, last step, turns) of each stage within steps 1..total_steps, both ends inclusive,
    for plots that shade the stages. For PlateauHorizon it reflects the stages observed so far."""
    bounds: list[tuple[int, int, int]] = []
    for step in range(1, total_steps + 1):
        if bounds and schedule.stage(step) == schedule.stage(bounds[-1][0]):
            bounds[-1] = (bounds[-1][0], step, bounds[-1][2])
        else:
            bounds.append((step, step, schedule.max_turns(step)))
    return bounds


# ---------------------------------------------------------------- the learning rate over the steps
def lr_at(step: int, steps: int, decay: str, warmup: int = 0) -> float:
    """The share of the base learning rate at `step` (1-based) of `steps`: 1 at step 1, and with decay,
    linear or along a half cosine, down to 1/steps at the last step (never 0: the last update counts).
    With `warmup` steps, the share first rises linearly: step s <= warmup gets s / (warmup + 1) of it
    (Adam makes its first steps full size whatever the gradient's scale: the warm-up keeps them small)."""
    low = 1.0 / steps
    ramp = step / (warmup + 1) if step <= warmup else 1.0
    if decay == "linear":
        return ramp * (1.0 - (step - 1) / steps)
    if decay == "cosine":
        t = (step - 1) / (steps - 1) if steps > 1 else 0.0
        return ramp * (low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * t)))
    return ramp
