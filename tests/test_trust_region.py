"""How far an update moves the policy, and what keeps it from moving too far: update_kl and
groups_informative in every step's metrics, the real-model defaults (warm-up, KL to the reference,
mini-batches, the update_kl guard, dynamic sampling), dynamic sampling itself, the replay script,
and a signal that lands during an update."""

import json
import os
import random
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, bench_stdout

import train
from rollout import Trajectory

TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "4",
        "--threads", "1", "--eval-every", "0", "--schedule", "4"]


def run_train(args, timeout=300):
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]


def test_every_step_logs_how_far_its_update_moved_the_policy(tmp_path):
    """update_kl is measured after the update; it grows with the learning rate; groups_informative
    is the share of groups whose scores differ (read back from the step's own log)."""
    kls = {}
    for lr in ("3e-4", "3e-2"):
        out = tmp_path / lr
        r = run_train([*TINY, "--steps", "3", "--lr", lr, "--entropy-coef", "0.001",
                       "--out", str(out)])
        assert r.returncode == 0, r.stderr[-2000:]
        rows = metrics(out)
        for m in rows:
            assert 0.0 <= m["groups_informative"] <= 1.0
            log = [json.loads(x) for x in open(out / "rollouts" / f"step_{m['step']:06d}.jsonl")]
            scores = {}
            for t in log:
                scores.setdefault(t["group"], set()).add(t["reward"])
            assert m["groups_informative"] == sum(len(s) > 1 for s in scores.values()) / len(scores)
        kls[lr] = [m["update_kl"] for m in rows if m.get("update_kl") is not None]
        assert kls[lr] and all(k >= 0 for k in kls[lr])
    assert max(kls["3e-2"]) > 10 * max(kls["3e-4"]), kls


def test_a_real_model_gets_the_trust_region_defaults(model_folder):
    model = model_folder
    cfg = train.parse_args(["--env", "corridor", "--model", str(model), "--batch-size", "8",
                            "--group-size", "4"])
    assert (cfg.lr, cfg.kl_coef, cfg.warmup_steps, cfg.max_update_kl) == (1e-6, 0.0, 3, 0.01)
    assert (cfg.mini_batch_size == 8 and cfg.dynamic_sampling is True
            and cfg.micro_batch_tokens == 4096)
    cfg = train.parse_args(["--env", "corridor"])  # the tiny model: as before
    assert (cfg.kl_coef, cfg.warmup_steps, cfg.max_update_kl, cfg.mini_batch_size,
            cfg.dynamic_sampling, cfg.micro_batch_tokens) == (0.0, 0, 0.0, None, False, 16384)
    cfg = train.parse_args(["--env", "corridor", "--model", str(model), "--kl-coef", "0.001",
                            "--no-dynamic-sampling", "--mini-batch-size", "32",
                            "--micro-batch-tokens", "8192"])  # flags win
    assert (cfg.kl_coef, cfg.dynamic_sampling, cfg.mini_batch_size,
            cfg.micro_batch_tokens) == (0.001, False, 32, 8192)


def test_the_guard_halves_the_learning_rate_after_a_step_that_moved_too_far(capsys):
    run = SimpleNamespace(cfg=SimpleNamespace(max_update_kl=0.01), lr_scale=1.0)
    m = {"update_kl": 0.005}
    train.guard(run, 1, m)
    assert run.lr_scale == 1.0 and m["lr_scale"] == 1.0
    m = {"update_kl": 0.02}
    train.guard(run, 2, m)
    assert (run.lr_scale == 0.5 and m["lr_scale"] == 0.5
            and "learning rate halved" in capsys.readouterr().out)
    run.cfg.max_update_kl = 0.0  # off
    train.guard(run, 3, {"update_kl": 9.0})
    assert run.lr_scale == 0.5


def traj(group: int, reward: float, item: int = 0) -> Trajectory:
    return Trajectory("corridor", item, group, [], [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0],
                      turns=1, status="done", reward=reward)


def test_dynamic_sampling_replaces_tied_groups_within_its_bound():
    """Groups whose scores tie are dropped and fresh tasks played in their place, with new group
    ids, until the batch holds --batch-size informative groups or --max-resample rounds are
    spent."""
    cfg = train.parse_args(["--env", "corridor", "--batch-size", "4", "--group-size", "2",
                            "--max-resample", "2"])
    run = SimpleNamespace(cfg=cfg, data_rng=random.Random(0), train_ids=list(range(100)))
    played = []

    def play_groups(item_ids, groups):  # fresh groups alternate: tied, informative
        played.append(sorted(set(groups)))
        return [traj(g, float(g % 2 and i % 2), item)
                for i, (item, g) in enumerate(zip(item_ids, groups))]

    first = [traj(0, 1.0), traj(0, 1.0), traj(1, 0.0), traj(1, 1.0), traj(2, 0.0), traj(2, 0.0),
             traj(3, 1.0), traj(3, 0.0)]  # groups 1 and 3 informative
    kept, extra = train.resample(run, first, play_groups, {})
    # round 1: 2 fresh groups, 5 informative; round 2: 1 more, tied; bound reached
    assert played == [[4, 5], [6]]
    assert {t.group for t in kept} == {1, 3, 5} and {t.group for t in extra} == {4, 5, 6}
    assert train.informative_groups(kept) == {1, 3, 5}


def test_dynamic_sampling_stops_after_max_resample_rounds():
    cfg = train.parse_args(["--env", "corridor", "--batch-size", "4", "--group-size", "2",
                            "--max-resample", "3"])
    run = SimpleNamespace(cfg=cfg, data_rng=random.Random(0), train_ids=list(range(100)))
    rounds = []

    def all_tied(item_ids, groups):
        rounds.append(len(set(groups)))
        return [traj(g, 0.0, item) for item, g in zip(item_ids, groups)]

    kept, extra = train.resample(run, [traj(0, 0.0), traj(0, 1.0)]
                                     + [traj(g, 0.0) for g in (1, 1, 2, 2, 3, 3)], all_tied, {})
    assert rounds == [3, 3, 3] and {t.group for t in kept} == {0} and len(extra) == 18


def test_extend_plays_a_tied_groups_own_task_again_under_its_id(capsys):
    """--resample extend: a tied group's task is played --group-size more times under the same group
    id; the grown group trains once it is informative, and a group still tied is extended again, up
    to --max-resample rounds. No fresh task is drawn."""
    cfg = train.parse_args(["--env", "corridor", "--batch-size", "3", "--group-size", "2",
                            "--max-resample", "2", "--dynamic-sampling", "--resample", "extend"])
    run = SimpleNamespace(cfg=cfg, data_rng=None,  # drawing a task would fail
                          train_ids=list(range(100)))
    played = []

    def play_groups(item_ids, groups):  # task 7 is won on its second round, task 9 never
        played.append(list(zip(item_ids, groups)))
        return [traj(g, float(item == 7 and len(played) == 1 and i == 0), item)
                for i, (item, g) in enumerate(zip(item_ids, groups))]

    first = [traj(0, 1.0, 5), traj(0, 0.0, 5), traj(1, 0.0, 7), traj(1, 0.0, 7), traj(2, 0.0, 9),
             traj(2, 0.0, 9)]
    kept, extra = train.resample(run, first, play_groups, {})
    assert played == [[(7, 1), (7, 1), (9, 2), (9, 2)], [(9, 2), (9, 2)]]
    # group 1 grew to 4 and trains; group 2 stays out
    assert sorted(t.group for t in kept) == [0, 0, 1, 1, 1, 1]
    assert len(extra) == 6 and train.informative_groups(kept) == {0, 1}
    with pytest.raises(SystemExit):  # extend is a kind of dynamic sampling
        train.parse_args(["--env", "corridor", "--no-dynamic-sampling", "--resample", "extend"])
    assert "--resample extend is a kind of dynamic sampling" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["fresh", "extend"])
def test_a_run_with_dynamic_sampling_trains_on_informative_groups_only(tmp_path, mode):
    out = tmp_path / "run"
    r = run_train([*TINY, "--steps", "2", "--dynamic-sampling", "--max-resample", "1",
                   "--resample", mode, "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    for m in metrics(out):
        assert m["trained_groups"] <= 2 and "resampled_groups" in m
        assert m.get("idle_rows", 0) == 0  # no tied group reaches the update
        assert m["skipped_update"] == (m["trained_groups"] == 0)  # nothing informative: no update


def test_a_signal_during_an_update_saves_that_steps_checkpoint(tmp_path):
    """SIGTERM while step 2's update runs: the update finishes (the critical section holds the
    signal), and the checkpoint says step 2, whose weights it holds; --resume then equals the
    straight run."""
    args = [*TINY, "--steps", "3", "--save-every", "-1"]
    straight = tmp_path / "straight"
    r = run_train([*args, "--out", str(straight), "--save-every", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import train\n"
        "real, calls = train.update, []\n"
        "def update(*args):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # held back until the update is made\n"
        "    return real(*args)\n"
        "train.update = update\n"
        "train.main(train.parse_args(sys.argv[1:]))\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(driver), *args, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-2000:]
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and len(metrics(out)) == 2
    r = run_train([*args, "--out", str(out), "--resume", "--save-every", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    drop = ("time_rollout_s", "time_update_s", "tokens_per_s", "time_sync_s")
    strip = lambda rows: [{k: v for k, v in m.items() if k not in drop} for m in rows]  # noqa: E731
    assert strip(metrics(out)) == strip(metrics(straight))
    from transformers import AutoModelForCausalLM
    a = AutoModelForCausalLM.from_pretrained(out / "checkpoint" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(straight / "checkpoint" / "model").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_replay_script_prints_update_kl_per_setting(tmp_path):
    out = tmp_path / "run"
    r = run_train([*TINY, "--steps", "1", "--entropy-coef", "0.001",  # every row computed
                   "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "bench/replay_step.py", str(out), "--step", "1",
                        "--try", "lr=3e-2", "--try", "lr=3e-6,mini_batch_size=2",
                        "--try", "lr=3e-4", "--probe-tasks", "2", "--threads", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["setting"] for x in rows] == ["(the run's own settings)", "--lr 3e-2",
                                            "--lr 3e-6 --mini-batch-size 2", "--lr 3e-4"]
    kl = [x["update_kl"] for x in rows]
    assert all(k is not None for k in kl) and kl[1] > kl[0] > kl[2]
    # vs_own: how far each result lies from the run's own; the own lr again (3e-4) lands on it
    vs = [x["vs_own"] for x in rows]
    assert vs[0] == 0 and vs[1] > kl[0] and vs[2] > 0.1 * kl[0] and abs(vs[3]) < 1e-6 * kl[0]
    assert not os.path.exists(out / ".replay")
    # the first setting is the recorded step's own update: the same update_kl as the run logged
    assert kl[0] == pytest.approx(metrics(out)[0]["update_kl"], rel=1e-3)


def test_a_later_step_replays_exactly_from_the_previous_steps_checkpoint(tmp_path, monkeypatch,
                                                                         capsys):
    """--weights CHECKPOINT: step 2 replayed from step 1's checkpoint (weights, optimizer moments,
    the update's shuffle stream) is the run's own update, the update_kl it logged, also when the
    rollout drew from torch's global RNG in between (as vLLM's CPU sampler does every decode step);
    from the same weights with a fresh optimizer (an HF folder) it is not. (replay_step.py runs as a
    command from the checkpoint, and in this process, its main() on the same command line, from
    the HF folder.)"""
    import shutil

    out = tmp_path / "run"
    flags = [*TINY, "--entropy-coef", "0.001", "--mini-batch-size", "4", "--out", str(out)]
    r = run_train([*flags, "--steps", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(out / "checkpoint", tmp_path / "ck1")
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import train\n"
        "real = train.update\n"
        "def update(*args):\n"
        "    torch.rand(7)  # a draw from the global RNG between the checkpoint and the update\n"
        "    return real(*args)\n"
        "train.update = update\n"
        "train.main(train.parse_args(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, str(driver), "--resume", "--out", str(out), "--steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    logged = metrics(out)[1]["update_kl"]
    got = {}
    for weights in ("ck1", "ck1/model"):
        argv = ["bench/replay_step.py", str(out), "--step", "2", "--weights",
                str(tmp_path / weights), "--probe-tasks", "1", "--threads", "1"]
        shown = bench_stdout(argv, monkeypatch, capsys, in_process=weights == "ck1/model")
        got[weights] = json.loads(shown.strip().splitlines()[-1])[0]["update_kl"]
    assert got["ck1"] == pytest.approx(logged, rel=1e-3)
    assert got["ck1/model"] != pytest.approx(logged, rel=0.05)
