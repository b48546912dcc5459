"""`python -m recipes.horizons` end to end on the built-in tiny model and Corridor (two arms, one
seed, two steps): the run folders, the figure and the table read back from the runs, a second call
that skips what is done; what a half-done study does with each run; bad flags refused in one line
before anything is written."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from recipes import horizons
from tools import paired

FAST = ["--batch-size", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-tasks", "2",
        "--threads", "1"]
ARMS = ["--env", "corridor", "--arms", "2", "2,4", "--steps", "2", "--eval-every", "1"]


def study(out, *more, train=()):
    return subprocess.run([sys.executable, "-m", "recipes.horizons", *ARMS, "--out", str(out),
                           *more, "--", *FAST, *train], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def jsonl(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_a_study_runs_reports_and_is_skipped_when_done(tmp_path, capsys):
    out, cache = tmp_path / "h", ["--cache-dir", str(tmp_path / "cache")]
    r = study(out, "--parallel", "2", train=cache)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[1/2] K2_s0: training from scratch" in r.stdout
    assert "K2-4_s0: step 2/2, K=4" in r.stdout  # a line per finished step, read from the run
    runs = {arm: out / horizons.run_name(arm, 0) for arm in ("2", "2,4")}
    assert [m["max_turns"] for m in jsonl(runs["2"] / "metrics.jsonl")] == [2, 2]
    assert [m["max_turns"] for m in jsonl(runs["2,4"] / "metrics.jsonl")] == [2, 4]  # it grew
    table = json.load(open(out / "horizons.json"))
    assert [t["arm"] for t in table["arms"]] == ["2", "2,4"] and table["eval_turns"] == 4
    for t in table["arms"]:
        run = runs[t["arm"]]
        evals, metrics = jsonl(run / "eval.jsonl"), jsonl(run / "metrics.jsonl")
        # every arm measured at the long horizon, every step, the table's numbers the run's own
        assert [(e["step"], e["max_turns"]) for e in evals] == [(0, 4), (1, 4), (2, 4)]
        assert [p["step"] for p in t["curve"]] == [0, 1, 2]
        assert t["held_out_first"]["per_seed"] == [evals[0]["success_rate"]]
        assert t["held_out_last"]["mean"] == evals[-1]["success_rate"]
        assert t["train_success_first"]["mean"] == metrics[0]["success_rate"]
        assert t["train_success_last"]["mean"] == metrics[-1]["success_rate"]
        assert t["minutes"]["mean"] > 0
    # the paired end: eval.py's per-task results of the two final checkpoints, on the curves' tasks
    held = json.load(open(out / "held_out_tasks.json"))["test"]
    ends = [paired.read_result(str(runs[arm] / "eval_end.json")) for arm in ("2", "2,4")]
    assert all(sorted(t["item_id"] for t in e["tasks"]) == sorted(held) for e in ends)
    (pair,) = table["paired"]
    c = paired.compare(*ends)
    assert (pair["arm"], pair["against"], pair["tasks"]) == ("2,4", "2", 2)
    assert pair["change"] == c["change"] and pair["ci95"] == c["ci95"]
    md = open(out / "horizons.md").read()
    assert "| K=2 | 1 |" in md and "| K=2->4 (ScalingInter-RL) | K=2 |" in md
    # chance beside the curves: each run's random policy on the same tasks and K, in the table
    chance = [jsonl(runs[arm] / "eval.jsonl")[0]["chance"] for arm in ("2", "2,4")]
    assert [t["chance"] for t in table["arms"]] == chance and 0 < chance[0] < 1
    assert "Chance (a random policy on the same tasks and K)" in md
    assert table["commit"] is None or len(table["commit"].split("+")[0]) == 40
    assert pair["by_seed"]["seeds"] == [0] and pair["by_seed"]["ci95"] is None  # one seed
    assert pair["by_seed"]["change"] == pytest.approx(c["end"] - c["start"])
    assert os.path.getsize(out / "horizons.png") > 10_000
    # the mechanisms' figures, read from the same runs
    r = subprocess.run([sys.executable, "bench/horizon_mechanisms.py", str(out), "--early", "1",
                        "--short", "2", "--long", "2,4"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    k2 = [m["success_rate"] for m in jsonl(runs["2"] / "metrics.jsonl")]
    assert f"training success, steps 1-1, K=2: {100 * k2[0]:.1f}%" in r.stdout
    assert "K=2, first: distance_" in r.stdout and "(1 seeds)" in r.stdout
    # again (in this process, the quicker): nothing is run, the report is written from the runs
    before = os.path.getmtime(runs["2"] / "metrics.jsonl")
    again = horizons.main([*ARMS, "--out", str(out), "--", *FAST, *cache])
    shown = capsys.readouterr().out
    assert shown.count("finished, skipped") == 2 and "0 of 2 runs to do" in shown
    assert os.path.getmtime(runs["2"] / "metrics.jsonl") == before
    assert again["arms"] == table["arms"] and again["paired"] == table["paired"]


@pytest.mark.parametrize("more,train,named", [
    (["--arms", "2", "0,3"], [], "--arms 0,3"),
    ([], ["--steps", "3"], "--steps"),
    (["--seeds", "1", "1"], [], "--seeds"),
])
def test_a_bad_flag_is_one_line_and_writes_nothing(tmp_path, more, train, named):
    out = tmp_path / "h"
    r = study(out, *more, train=train)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def fake_run(folder, steps: int, checkpoint_step=None, finished=False, **config):
    os.makedirs(folder)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "success_rate": 0.0, "tokens_per_s": 0.0}) + "\n"
                     for s in range(1, steps + 1))
    if checkpoint_step is not None:
        os.makedirs(folder / "checkpoint")
        torch.save({"step": checkpoint_step}, folder / "checkpoint" / "trainer_state.pt")
    if finished:
        (folder / "summary.json").write_text("{}")
        (folder / "eval_end.json").write_text(json.dumps(
            {"tasks": [{"item_id": 1, "scores": [1.0]}]}))


def test_a_half_done_study_resumes_restarts_and_skips(tmp_path, capsys):
    """What the second call of a study does with each run, and the settings it refuses to mix."""
    out = tmp_path / "h"
    argv = ["--env", "corridor", "--arms", "2", "2,4", "5", "--steps", "2", "--eval-every", "1",
            "--out", str(out), "--", *FAST, "--lr", "1e-3"]
    a = horizons.parse_args(argv)
    killed, empty, done = (out / horizons.run_name(arm, 0) for arm in ("2", "2,4", "5"))
    fake_run(killed, 1, checkpoint_step=1)
    fake_run(empty, 1)  # metrics, no checkpoint: nothing to resume from
    fake_run(done, 2, checkpoint_step=2, finished=True)
    jobs = {j.arm: j for j in a.jobs}
    assert horizons.plan(a, jobs["2"], "held.json").startswith("resuming from its checkpoint")
    (what, cmd), (then, ev) = jobs["2"].commands
    assert what == "train" and cmd[1:5] == ["train.py", "--resume", "--out", str(killed)]
    assert "--config" not in cmd and "--lr" in cmd and jobs["2"].last_step == 1
    assert then == "evaluate" and ev[ev.index("--tasks-file") + 1] == "held.json"
    assert ev[ev.index("--max-turns") + 1] == "5"  # the longest arm's horizon
    assert horizons.plan(a, jobs["2,4"], "held.json").startswith("training from scratch")
    assert not empty.exists()  # train.py would refuse a folder holding metrics
    cmd = jobs["2,4"].commands[0][1]
    assert [cmd[cmd.index(f) + 1] for f in ("--schedule", "--schedule-every", "--save-every")] == \
        ["2,4", "1", "1"]
    assert horizons.plan(a, jobs["5"], "held.json") == "finished, skipped"
    assert not jobs["5"].commands
    # a saved run with other settings than this command's is refused, naming the setting
    with open(done / "config.json", "w") as f:
        json.dump({"lr": 3e-4}, f)
    with pytest.raises(SystemExit) as e:
        horizons.parse_args(argv)
    assert e.value.code == 2 and "lr = 0.0003" in capsys.readouterr().err
    # and train.py's own checks run on every run's command line before anything is written
    with pytest.raises(SystemExit):
        horizons.parse_args([*ARMS, "--out", str(tmp_path / "x"), "--", "--lr", "-1"])
    err = capsys.readouterr().err
    assert "--lr" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_the_test_by_seed_is_each_seeds_difference_with_a_t_interval(tmp_path):
    """Three seeds, hand-computed: the staged arm's end minus the fixed arm's, seed by seed."""
    a = horizons.parse_args(["--env", "corridor", "--arms", "2", "2,4", "--seeds", "0", "1", "2",
                             "--steps", "2", "--out", str(tmp_path / "h"), "--", *FAST])
    ends = {"2": [0.0, 0.5, 0.25], "2,4": [0.5, 0.5, 1.0]}  # differences 0.5, 0.0, 0.75
    for arm, xs in ends.items():
        for seed, x in enumerate(xs):
            run = tmp_path / "h" / horizons.run_name(arm, seed)
            os.makedirs(run)  # two tasks: Avg@2 = x
            (run / "eval_end.json").write_text(json.dumps({"tasks": [
                {"item_id": 48, "scores": [x, x]}, {"item_id": 49, "scores": [x, x]}]}))
    from recipes.horizons_report import by_seed

    r = by_seed(a, "2,4", "2")
    assert r["seeds"] == [0, 1, 2] and r["differences"] == [0.5, 0.0, 0.75]
    # mean 5/12; sd sqrt(((1/12)^2 + (5/12)^2 + (4/12)^2) / 2) = sqrt(7/48); t(2) = 4.303
    half = 4.303 * (7 / 48) ** 0.5 / 3 ** 0.5
    assert r["change"] == pytest.approx(5 / 12)
    assert r["ci95"] == pytest.approx([5 / 12 - half, 5 / 12 + half])


def test_a_runs_end_weighs_its_tasks_alike_whatever_their_sample_counts(tmp_path):
    """Avg@n over tasks: each task's mean, then the mean over tasks (4 wins of 4 and 0 of 1 is
    0.5, not 4 / 5)."""
    from recipes.horizons_report import end_avg

    (tmp_path / "eval_end.json").write_text(json.dumps({"tasks": [
        {"item_id": 48, "scores": [1.0, 1.0, 1.0, 1.0]}, {"item_id": 49, "scores": [0.0]}]}))
    assert end_avg(str(tmp_path)) == 0.5


def test_a_study_into_a_folder_in_use_is_refused_in_one_line(tmp_path, capsys):
    """A second study started into the --out of a running one would delete that one's run
    folders: refused, naming the holder, while the lock is held; free once it is let go."""
    from trainer.checkpoints import hold_folder

    out = tmp_path / "h"
    lock = hold_folder(str(out))
    argv = [*ARMS, "--out", str(out), "--", *FAST]
    with pytest.raises(SystemExit) as e:
        horizons.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is in use by pid" in err and len(err.strip().splitlines()) == 1
    lock.close()
    horizons.parse_args(argv)  # free again


def test_a_damaged_run_is_reported_and_skipped_while_the_others_go_on(tmp_path, capsys):
    out = tmp_path / "h"
    argv = ["--env", "corridor", "--arms", "2", "2,4", "5", "--steps", "2", "--eval-every", "1",
            "--out", str(out), "--", *FAST]
    cut, garbled, done = (out / horizons.run_name(arm, 0) for arm in ("2", "2,4", "5"))
    fake_run(cut, 1, checkpoint_step=1)
    with open(cut / "checkpoint" / "trainer_state.pt", "r+b") as f:
        f.truncate(20)  # cut short
    fake_run(garbled, 1, checkpoint_step=1)
    with open(garbled / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": "two", "success_rate": 0.0}) + "\n")
    fake_run(done, 2, checkpoint_step=2, finished=True)
    (done / "eval_end.json").write_text(json.dumps(
        {"tasks": [{"item_id": 1, "scores": [1.0]}], "overall": {"avg@1": 1.0}}))
    result = horizons.main(argv)
    shown = capsys.readouterr().out
    assert "K2_s0: damaged, skipped: " in shown and "trainer_state.pt cannot be read" in shown
    assert "K2-4_s0: damaged, skipped: metrics.jsonl has a line that is not a step's" in shown
    assert "K5_s0: finished, skipped" in shown and "0 of 3 runs to do" in shown
    assert result["damaged_runs"] == ["K2_s0", "K2-4_s0"]
    assert [t["seeds"] for t in result["arms"]] == [[], [], [0]]
    assert result["commit"] is None or len(result["commit"].split("+")[0]) == 40


def test_a_longer_study_into_a_begun_one_is_refused_in_words(tmp_path, capsys):
    out = tmp_path / "h"
    run = out / horizons.run_name("2", 0)
    fake_run(run, 2, checkpoint_step=2, finished=True)
    (run / "config.json").write_text(json.dumps({"steps": 2}))
    with pytest.raises(SystemExit):
        horizons.parse_args([*ARMS[:-4], "--steps", "4", "--eval-every", "1", "--out", str(out),
                             "--", *FAST])
    err = capsys.readouterr().err
    assert "--steps 4" in err and "was run for 2 steps" in err and "schedule_every" not in err


def test_the_figure_keeps_equal_curves_apart_and_plots_turns(tmp_path, monkeypatch):
    """Two arms whose curves are equal stay told apart (their own dashes); success axes start at
    0 and end at 1, steps are whole numbers, and a third panel plots turns per episode."""
    import matplotlib.figure
    from matplotlib.ticker import MaxNLocator
    from types import SimpleNamespace

    from recipes.horizons_report import draw

    seen = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: seen.setdefault("fig", fig))
    curve = [{"step": s, "mean": 0.5, "min": 0.4, "max": 0.6} for s in (0, 5)]
    arm = {"curve": curve, "train_curve": [[1, 0.5], [2, 0.5]], "turns_curve": [[1, 3.0],
                                                                                [2, 2.5]],
           "held_out_tasks": 12, "chance": 0.2}
    table = [{**arm, "arm": "2", "label": "K=2"}, {**arm, "arm": "2,4", "label": "K=2->4"}]
    a = SimpleNamespace(eval_turns=4, steps=5, cfg=SimpleNamespace(eval_samples=2))
    draw(a, table, str(tmp_path / "h.png"))
    held, train, turns = seen["fig"].axes
    assert "turns" in turns.get_title() and [tuple(x) for x in turns.lines[1].get_xydata()] == [
        (1, 3.0), (2, 2.75)]  # the trailing mean
    styles = {ln.get_label(): (ln.get_linestyle(), ln.get_markersize()) for ln in held.lines
              if ln.get_label() in ("K=2", "K=2->4")}
    assert len(set(styles.values())) == 2
    assert held.get_ylim() == train.get_ylim() == (0, 1.03) and turns.get_ylim()[0] == 0
    assert all(isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
               and ax.xaxis.get_major_locator()._integer for ax in (held, train, turns))


def test_a_model_another_process_finished_first_is_taken_as_built(tmp_path, monkeypatch):
    """Two runs of a study build the same model at once: the one that renames second finds the
    folder already there (the rename fails on a full folder) and takes the winner's."""
    import models.builtin as builtin

    path, real_replace = str(tmp_path / "model"), os.replace

    def winner_first(src, dst):  # the other process renames between our build and our rename
        os.makedirs(dst)
        open(os.path.join(dst, "config.json"), "w").write("{}")
        real_replace(src, dst)

    monkeypatch.setattr(builtin.os, "replace", winner_first)

    def build(tmp):
        os.makedirs(tmp)
        open(os.path.join(tmp, "config.json"), "w").write('{"ours": 1}')

    assert builtin.build_once(path, build) == path
    assert json.load(open(os.path.join(path, "config.json"))) == {}
    assert os.listdir(tmp_path) == ["model"]  # our copy removed
