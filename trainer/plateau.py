"""--schedule-kind plateau: PlateauHorizon, a horizon schedule that is not in the paper. It
moves to the next horizon when the moving-average success rate has stopped improving, instead
of at fixed steps (scheduler.StepwiseHorizon, ScalingInter-RL).

Importing this module registers it into scheduler.SCHEDULES (trainer/config.py imports it, so
that the flag's choices list it). train.py feeds it each step's success rate through
`schedule.observe`, which the core's schedules ignore.
"""

from __future__ import annotations

from scheduler import HorizonSchedule, check_rounds, check_step, register_schedule


class PlateauHorizon(HorizonSchedule):
    """Advance to the next horizon when the success rate has plateaued at the current one.

    After each step, `observe(step, success_rate)` appends the rate to the stage's history.
    Once the stage has `window` observations, the moving average of the last `window` rates is
    compared with the best moving average of this stage: more than `min_delta` above it is an
    improvement (the best is updated, the stall counter reset); otherwise the stall counter
    grows. When it reaches `patience`, the next horizon starts at the following step, with a
    fresh history and best. So a stage lasts at least window + patience steps. The last
    horizon is kept to the end. `stage(step)` is exact for past steps as well (stage start
    steps are recorded), so scheduler.stage_bounds works.
    """

    kind = "plateau"

    def __init__(self, rounds: list[int], patience: int = 20, min_delta: float = 0.01,
                 window: int = 10):
        self.rounds = check_rounds(rounds)
        if int(patience) < 1 or int(window) < 1 or min_delta < 0:
            raise ValueError("plateau schedule needs patience >= 1, window >= 1, "
                             f"min_delta >= 0; got {patience}, {window}, {min_delta}")
        self.patience, self.min_delta = int(patience), float(min_delta)
        self.window = int(window)
        self.stage_starts = [1]  # each stage's first step; len - 1 is the current stage
        self.best: float | None = None  # best moving average in the current stage
        self.stall = 0  # observations since the last improvement, once the window is full
        self.history: list[float] = []  # the current stage's last `window` success rates
        self.last_step = 0  # the last step observed (each is observed once, in order)

    def stage(self, step: int) -> int:
        check_step(step)
        return sum(start <= step for start in self.stage_starts) - 1

    def max_turns(self, step: int) -> int:
        return self.rounds[self.stage(step)]

    def observe(self, step: int, success_rate: float) -> None:
        step = check_step(step)
        if step <= self.last_step:
            raise ValueError(f"step {step} observed after step {self.last_step}; each step "
                             "is observed once, in order (a resumed run must start at the "
                             "checkpoint's step + 1)")
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
        return (f"plateau: {' -> '.join(map(str, self.rounds))} turns; next horizon after "
                f"{self.patience} steps without +{self.min_delta} on the {self.window}-step "
                f"mean success rate (now stage {len(self.stage_starts) - 1})")

    def _config(self) -> dict:
        return {"rounds": list(self.rounds), "patience": self.patience,
                "min_delta": self.min_delta, "window": self.window}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stage_starts": list(self.stage_starts),
                "best": self.best, "stall": self.stall, "history": list(self.history),
                "last_step": self.last_step}

    def load_state_dict(self, d: dict) -> None:
        super().load_state_dict(d)
        self.stage_starts = [int(s) for s in d["stage_starts"]]
        self.best = None if d["best"] is None else float(d["best"])
        self.stall, self.last_step = int(d["stall"]), int(d["last_step"])
        self.history = [float(x) for x in d["history"]]


@register_schedule("plateau")
def _plateau(rounds: list[int], every: int, **kw) -> HorizonSchedule:
    # `every` is unused: the stage length comes from training
    return PlateauHorizon(rounds, **kw)
