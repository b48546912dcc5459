"""scheduler.py: stage boundaries, CLI parsing, exact resume, stage_bounds; and trainer/plateau.py's
PlateauHorizon, which registers --schedule-kind plateau when imported."""

import copy
import json
import random
import subprocess
import sys

import pytest
from conftest import ROOT

from scheduler import FixedHorizon, StepwiseHorizon, make_schedule, stage_bounds, stage_steps
from trainer.plateau import PlateauHorizon


def test_fixed():
    s = FixedHorizon(15)
    assert [s.max_turns(k) for k in (1, 2, 100, 10_000)] == [15] * 4
    assert "15" in s.describe()
    with pytest.raises(ValueError):
        s.max_turns(0)  # steps count from 1


def test_stepwise_every_boundary():
    s = StepwiseHorizon([10, 20, 30], every=100)
    expected = {1: 10, 99: 10, 100: 10, 101: 20, 200: 20, 201: 30, 300: 30, 301: 30, 5000: 30}
    assert {k: s.max_turns(k) for k in expected} == expected
    assert [s.stage(k) for k in (1, 100, 101, 201, 5000)] == [0, 0, 1, 2, 2]
    assert "10 -> 20 -> 30" in s.describe() and "100" in s.describe()
    one = StepwiseHorizon([4, 8], every=1)  # every=1: one step per stage
    assert [one.max_turns(k) for k in (1, 2, 3)] == [4, 8, 8]


def test_decreasing_rounds_allowed():
    s = make_schedule("30,20,10", every=2)
    assert [s.max_turns(k) for k in range(1, 7)] == [30, 30, 20, 20, 10, 10]


def test_stage_steps_share_the_steps_rounding_up():
    """Without --schedule-every the stages share --steps evenly, rounded up: every stage but the
    last gets the same length, and the last is never longer than the others (rounded down, 16
    steps over 3 stages would be 5, 5 and 6: the longest horizon would get the most steps)."""
    assert stage_steps("10,20,30", 15) == 5  # 1-5, 6-10, 11-15
    assert stage_steps("10,20,30", 16) == 6  # 1-6, 7-12, 13-16
    assert stage_steps("2,4,8", 40) == 14  # 1-14, 15-28, 29-40
    assert stage_steps("10,20", 3) == 2
    assert stage_steps("10,20,30", 2) == 1  # at least one step a stage
    assert stage_steps("15", 7) == 7  # one stage: all of them
    assert stage_steps("10,20,30", 16, every=4) == 4  # --schedule-every wins
    s = StepwiseHorizon([10, 20, 30], stage_steps("10,20,30", 16))
    assert stage_bounds(s, 16) == [(1, 6, 10), (7, 12, 20), (13, 16, 30)]


def test_make_schedule_forms():
    assert isinstance(make_schedule("15", every=100), FixedHorizon)
    assert isinstance(make_schedule(" 10, 20 ,30", every=100), StepwiseHorizon)
    assert isinstance(make_schedule("10,20", every=5, kind="plateau", patience=3, window=2),
                      PlateauHorizon)
    # nothing to advance to
    assert isinstance(make_schedule("15", every=5, kind="plateau"), FixedHorizon)


@pytest.mark.parametrize("bad", ["", " ", "0", "-3", "a,b", "10,,20", "10,", ",10", "10;20", "1.5",
                                 "10,0,20"])
def test_make_schedule_rejects(bad):
    with pytest.raises(ValueError, match="--schedule"):
        make_schedule(bad, every=100)


def test_the_plateau_kind_is_registered_by_its_layer():
    """The core knows "step" alone; importing trainer/plateau.py adds "plateau" (a fresh process:
    this file's own import has registered it here already)."""
    code = ("import scheduler; before = sorted(scheduler.SCHEDULES); import trainer.plateau; "
            "print(before, sorted(scheduler.SCHEDULES))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split("\n")[0] == "['step'] ['plateau', 'step']", out.stderr


def test_make_schedule_rejects_bad_every_and_kind():
    with pytest.raises(ValueError, match="--schedule-every"):
        make_schedule("10,20", every=0)
    with pytest.raises(ValueError, match="kind"):
        make_schedule("10,20", every=10, kind="cosine")
    with pytest.raises(ValueError):
        make_schedule("10,20", every=10, patience=3)  # plateau options on a stepwise schedule
    with pytest.raises(ValueError):
        PlateauHorizon([10, 20], patience=0)


def _resume_check(make, total, resume_at, rates):
    """Run `make()` uninterrupted; run another to `resume_at`, save its state (through JSON, as a
    checkpoint would), load it into a fresh one and continue. Both must agree on every later
    step."""
    straight = make()
    turns_straight = []
    for step in range(1, total + 1):
        turns_straight.append(straight.max_turns(step))
        straight.observe(step, rates[step - 1])

    first = make()
    for step in range(1, resume_at + 1):
        first.max_turns(step)
        first.observe(step, rates[step - 1])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    turns_resumed = turns_straight[:resume_at]
    for step in range(resume_at + 1, total + 1):
        turns_resumed.append(resumed.max_turns(step))
        resumed.observe(step, rates[step - 1])
    assert turns_resumed == turns_straight
    assert resumed.state_dict() == straight.state_dict()
    return turns_straight


@pytest.mark.parametrize("resume_at", [1, 9, 10, 11, 25, 39])
def test_stepwise_resume_exact(resume_at):
    rates = [0.0] * 40
    turns = _resume_check(lambda: StepwiseHorizon([5, 8, 12], every=10), 40, resume_at, rates)
    assert turns == [5] * 10 + [8] * 10 + [12] * 20


@pytest.mark.parametrize("resume_at", [1, 4, 12, 13, 14, 30, 59])
def test_plateau_resume_exact(resume_at):
    # success rises for 10 steps, then stays flat: the plateau must advance, and a resume anywhere
    # (mid-window, mid-patience, right at an advance) must continue identically
    g = random.Random(0)
    rates = [min(1.0, 0.1 * k) if k < 10 else 0.5 + 0.001 * g.random() for k in range(60)]
    turns = _resume_check(lambda: PlateauHorizon([4, 6, 9], patience=3, min_delta=0.01, window=2),
                          60, resume_at, rates)
    # advanced through all stages
    assert turns[0] == 4 and turns[-1] == 9 and sorted(turns) == turns


@pytest.mark.parametrize("resume_at", [2, 3, 4])
def test_plateau_resume_exact_while_the_best_success_is_zero(resume_at):
    """A stage's best moving average of exactly 0.0 is a best like any other: read back as
    "none yet", the resumed stage would advance one step late."""
    turns = _resume_check(lambda: PlateauHorizon([4, 6], patience=3, min_delta=0.01, window=2),
                          12, resume_at, [0.0] * 12)
    assert turns == [4] * 5 + [6] * 7


def test_plateau_advances_by_hand():
    s = PlateauHorizon([2, 3, 5], patience=2, min_delta=0.1, window=2)
    # step 1: window not full; 2: mean 0.5 -> best; 3: mean 0.5 stall 1; 4: stall 2 -> stage 1 from
    # step 5
    for step, rate in enumerate([0.5, 0.5, 0.5, 0.5], start=1):
        assert s.max_turns(step) == 2
        s.observe(step, rate)
    assert s.max_turns(5) == 3 and s.stage_starts == [1, 5]
    assert s.max_turns(4) == 2  # past steps keep their stage
    # stage 1 starts fresh: steps 5-6 fill the window, a real improvement at 7 resets the stall
    for step, rate in zip(range(5, 9), [0.5, 0.5, 0.9, 0.9]):
        s.observe(step, rate)
    assert s.max_turns(9) == 3 and s.stall == 0
    with pytest.raises(ValueError, match="observed"):
        s.observe(8, 0.9)  # the same step twice: what a one-off resume would do


def test_plateau_last_stage_is_kept():
    s = PlateauHorizon([2, 3], patience=1, min_delta=0.0, window=1)
    for step in range(1, 20):
        s.observe(step, 0.0)
    assert s.max_turns(100) == 3 and len(s.stage_starts) == 2


def test_load_refuses_another_schedule():
    with pytest.raises(ValueError, match="--schedule"):
        StepwiseHorizon([10, 20], 5).load_state_dict(StepwiseHorizon([10, 30], 5).state_dict())
    with pytest.raises(ValueError):
        FixedHorizon(10).load_state_dict(StepwiseHorizon([10, 20], 5).state_dict())
    state = PlateauHorizon([1, 2]).state_dict()
    # same config: fine
    FixedHorizon(3).load_state_dict(copy.deepcopy(FixedHorizon(3).state_dict()))
    with pytest.raises(ValueError):
        PlateauHorizon([1, 2], patience=7).load_state_dict(state)


def test_stage_bounds():
    assert stage_bounds(StepwiseHorizon([10, 20, 30], every=100), 250) == [
        (1, 100, 10), (101, 200, 20), (201, 250, 30)]
    assert stage_bounds(StepwiseHorizon([10, 20, 30], every=100), 50) == [(1, 50, 10)]
    assert stage_bounds(FixedHorizon(7), 3) == [(1, 3, 7)]
    # equal turns in consecutive stages still give separate stages
    assert stage_bounds(StepwiseHorizon([5, 5, 8], every=2), 6) == [(1, 2, 5), (3, 4, 5), (5, 6, 8)]
    s = PlateauHorizon([2, 3, 5], patience=2, min_delta=0.1, window=2)
    for step in range(1, 5):
        s.observe(step, 0.5)
    assert stage_bounds(s, 8) == [(1, 4, 2), (5, 8, 3)]
