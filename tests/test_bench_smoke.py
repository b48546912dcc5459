"""The bench scripts still run (tiny settings); their numbers are read by people, not asserted."""

import os
import re
import subprocess
import sys

from conftest import ROOT, bench_stdout


def test_env_throughput_bench_runs():
    out = subprocess.run([sys.executable, "bench/env_throughput.py", "--env", "textcraft",
                          "--sizes", "4", "--seconds", "0.3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "in-process step rate" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["single", "4"], ["batch", "4"]]
    assert all(r[5] == "0" for r in rows)  # no errors


def test_soak_bench_runs():
    out = subprocess.run([sys.executable, "bench/soak.py", "--env", "corridor", "--minutes", "0.05",
                          "--instances", "8", "--steps", "3", "--idle-timeout", "0.5",
                          "--sample-s", "0.5",
                          # 3 s are no warm-up: the RSS check is for real soaks
                          "--max-rss-growth", "1000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["elapsed_s", "live", "abandoned", "reaped", "rss_mb", "steps/s",
                                "errors"]
    summary = next(line for line in lines if line.startswith("corridor:") and "rounds" in line)
    assert "0 errors" in summary and "live at the end 0" in summary
    abandoned, reaped = re.search(r"abandoned (\d+), reaped (\d+)", summary).groups()
    assert int(abandoned) > 0 and reaped == abandoned
    assert "RSS peak after warm-up" in lines[-1]


def test_turn_cache_bench_runs(tmp_path):
    import models.tiny as tiny_model
    path = tiny_model.build(str(tmp_path / "m"), env_names=("corridor",), tokenizer="words",
                            layers=1, hidden=32)
    out = subprocess.run([sys.executable, "bench/turn_cache.py", "--env", "corridor",
                          "--tasks", "4", "--turns", "3", "--max-new-tokens", "4", "--model", path,
                          "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    full, kept = (re.search(r"encoded\s+([\d,]+)\s+reused\s+([\d,]+)", line).groups()
                  for line in out.stdout.splitlines() if "encoded" in line)
    assert full[1] == "0" and int(kept[1].replace(",", "")) > 0  # only the second run reuses
    assert "identical episodes 4/4" in out.stdout
    out = subprocess.run([sys.executable, "bench/turn_cache.py", "--env", "corridor",
                          "--tasks", "6", "--turns", "3", "--max-new-tokens", "8", "--model", path,
                          "--threads", "1", "--compare", "compaction", "--temperature", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    every, going = (int(re.search(r"decoded rows\s+([\d,]+)", line).group(1).replace(",", ""))
                    for line in out.stdout.splitlines() if "decoded rows" in line)
    # sampled, one seed: the same
    assert going <= every and "identical episodes 6/6" in out.stdout, out.stdout


def test_main_command_bench_reads_a_run(tmp_path, monkeypatch):
    """bench/main_command.py's plumbing on a tiny Corridor run: the run folder's summary.json and
    eval.jsonl read back into the gain and the minutes the goal is judged on (summary.json)."""
    import json
    import os
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import main_command
    monkeypatch.setitem(main_command.COMMANDS, "corridor", [
        "--env", "corridor", "--steps", "2", "--schedule", "3", "--batch-size", "2",
        "--group-size", "2", "--max-new-tokens", "4", "--threads", "1", "--eval-tasks", "4",
        "--cache-dir", str(tmp_path / "cache")])
    r = main_command.run("corridor", 0, str(tmp_path / "run"))
    with open(tmp_path / "run" / "eval.jsonl") as f:
        evals = [json.loads(x) for x in f]
    assert [e["step"] for e in evals] == [0, 2]
    assert r["gain"] == 100 * (evals[-1]["success_rate"] - evals[0]["success_rate"])
    assert 0 < r["minutes"] <= r["wall_minutes"] and r["tasks"] == 4
    assert r["met"] == (r["gain"] >= 20 and r["minutes"] <= 30)


def test_horizon_comparison_runs_on_corridor(tmp_path):
    """bench/horizons.py (a wrapper of recipes.horizons) on CPU with tiny settings: three schedules
    from the same start, two steps each, run side by side, then one PNG and a table (Markdown and
    JSON) naming device, speeds and memory."""
    import json
    import os
    out = tmp_path / "h"
    r = subprocess.run([sys.executable, "bench/horizons.py", "--env", "corridor",
                        "--horizons", "2", "4", "2,4", "--steps", "2", "--eval-every", "1",
                        "--parallel", "3", "--device", "cpu", "--no-save",
                        "--out", str(out),
                        "--train", f"--batch-size 2 --group-size 2 --max-new-tokens 4 --threads 1 "
                                   f"--eval-tasks 4 "
                                   f"--entropy-coef 0.01 "  # every row computed, tied groups too
                                   f"--cache-dir {tmp_path / 'cache'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    table = json.load(open(out / "horizons.json"))
    assert ([t["arm"] for t in table["arms"]] == ["2", "4", "2,4"]
            and table["device"].startswith("CPU"))
    for t in table["arms"]:
        assert [p["step"] for p in t["curve"]] == [0, 1, 2]
        assert t["gen_tokens_per_s"] > 0 and t["train_tokens_per_s"] > 0
    metrics = [json.loads(x) for x in open(out / "K2-4_s0" / "metrics.jsonl")]
    assert [m["max_turns"] for m in metrics] == [2, 4]  # ScalingInter-RL: the horizon grew
    assert (os.path.getsize(out / "horizons.png") > 10_000
            and "| K=2->4 (ScalingInter-RL) |" in open(out / "horizons.md").read())
    # --no-save: metrics only, and so no paired end comparison
    assert not os.path.exists(out / "K2-4_s0" / "checkpoint") and table["paired"] == []


def test_first_thoughts_reads_recipes_and_judges_marks(tmp_path):
    """The expert's checked thoughts are right by construction; the same thoughts with every mark
    flipped are all wrong, and the recipes listed are the expert's chain."""
    import json
    from env_server.textcraft import TextCraftEnv
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import first_thoughts
    world = TextCraftEnv.load_world(None)
    env = TextCraftEnv(world)
    flip = {"craft": "get", "get": "craft"}
    tasks, right, wrong, chains = [], [], [], {}
    for idx in world.splits["test"][::8]:
        obs = env.reset(idx)
        action = env.expert_action()
        thought = env.expert_thought(action, checked=True)
        chains[idx] = thought.count(" using ")
        tasks.append({"item_id": idx, "category": TextCraftEnv.task_category(world, idx),
                      "scores": [1.0]})
        for rows, text in ((right, thought),
                           (wrong, re.sub(r": (craft|get)", lambda m: ": " + flip[m[1]], thought))):
            rows.append({"item_id": idx, "messages": [
                {"role": "user", "content": "You are playing a crafting game."},
                {"role": "assistant", "content": "OK."},
                {"role": "user", "content": obs},
                {"role": "assistant", "content": f"Thought: {text}\nAction: {action}"}]})
    category = {t["item_id"]: t["category"] for t in tasks}
    good, bad = (first_thoughts.summarize(world, right, category),
                 first_thoughts.summarize(world, wrong, category))
    assert sum(s["episodes"] for s in good.values()) == len(tasks)
    assert all(s["marks"] > 0 and s["marks_right"] == 1.0 and s["marked"] == 1.0
               for s in good.values())
    assert all(s["marks_right"] == 0.0 for s in bad.values())
    for cat, s in good.items():
        ids = [i for i in chains if category[i] == cat]
        assert abs(s["recipes"] - sum(chains[i] for i in ids) / len(ids)) < 1e-9
    # the script end to end: a result file and its episodes beside it
    (tmp_path / "r.json").write_text(json.dumps({"config": {"env": "textcraft"}, "tasks": tasks}))
    (tmp_path / "r.rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in right))
    out = subprocess.run([sys.executable, "bench/first_thoughts.py", str(tmp_path / "r.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (all(line.endswith("100%") for line in out.stdout.splitlines()[1:])
            and len(out.stdout.splitlines()) > 1)
    missing = subprocess.run([sys.executable, "bench/first_thoughts.py",
                              str(tmp_path / "nope.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "nope.json not found" in missing.stderr
    (tmp_path / "r.json").write_text(json.dumps({"config": {"env": "textcraft"}}))  # no tasks
    bad = subprocess.run([sys.executable, "bench/first_thoughts.py", str(tmp_path / "r.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().endswith("(it has no per-task scores)")


def test_sampler_gap_and_replay_step_read_a_step_log(tmp_path, monkeypatch, capsys):
    """The HF engine in fp32 samples with the trainer's own module: its recorded log-probs are the
    trainer's to float precision on every sampled token (a row or position off by one would not be);
    bf16 rounds them apart. replay_step.py puts the step through train.update (the run's setting
    first, moving the policy not at all against itself), and rollout_overhead.py plays and trains
    once, both through the update's own calls. (sampler_gap.py runs as a command in fp32 and in
    this process, its main() on the same command line, in bf16.)"""
    import json

    import models.tiny as tiny_model
    path = tiny_model.build(str(tmp_path / "m"), env_names=("corridor",), tokenizer="words",
                            layers=1, hidden=32)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--model", path,
                          "--steps", "1", "--batch-size", "2", "--group-size", "4",
                          "--max-new-tokens", "4", "--engine", "hf", "--threads", "1",
                          "--eval-every", "0", "--schedule", "3", "--no-dynamic-sampling",
                          "--out", str(run)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    gap = {}
    for dtype in ("fp32", "bf16"):
        argv = ["bench/sampler_gap.py", str(run / "rollouts" / "step_000001.jsonl"),
                "--env", "corridor", "--model", path, "--dtype", dtype, "--threads", "1"]
        shown = bench_stdout(argv, monkeypatch, capsys, in_process=dtype == "bf16")
        gap[dtype] = json.loads(shown.strip().splitlines()[-1])
    assert gap["fp32"]["rows"] >= 8 and gap["fp32"]["tokens"] > 8  # every round of the step
    assert gap["fp32"]["max_abs"] < 1e-4 and gap["fp32"]["outside_clip"] == 0
    assert gap["bf16"]["mean_abs"] > 10 * gap["fp32"]["mean_abs"]
    out = subprocess.run([sys.executable, "bench/replay_step.py", str(run), "--step", "1",
                          "--try", "lr=0.01", "--probe-tasks", "1", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["setting"] for r in rows] == ["(the run's own settings)", "--lr 0.01"], out.stdout
    assert rows[0]["vs_own"] == 0.0
    out = subprocess.run([sys.executable, "bench/rollout_overhead.py", "--env", "corridor",
                          "--model", path, "--trajectories", "4", "--turns", "2",
                          "--max-new-tokens", "4", "--threads", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "training:" in out.stdout, out.stderr[-2000:]



def test_anchor_groups_counts_a_hand_made_log(tmp_path):
    """Two samples of one task: A is refused twice (the same text at turns 2 and 3), B succeeds on
    turn 2. Anchor groups: the opening {A1, B1}, the refusal {A2, A3}, B's success alone. At gamma
    0.5 the returns are A 0, 0, 0 and B 0.5, 1: only the opening's two turns differ."""
    import json

    import pytest

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import anchor_groups
    from recipes.sft import load_log

    def traj(replies, reward, turn_rewards):
        msgs = []
        for obs, act in replies:
            msgs += [{"role": "user", "content": obs}, {"role": "assistant", "content": act}]
        return {"env": "textcraft", "item_id": 1, "group": 0, "messages": msgs,
                "token_ids": [1, 2], "loss_mask": [0, 1], "logprobs": [0.0, -0.1],
                "turns": len(replies), "status": "done", "reward": reward,
                "turn_rewards": turn_rewards}

    a = traj([("start", "craft x"), ("refused", "craft x"), ("refused", "get y")], 0.0,
             [0.0, 0.0, 0.0])
    b = traj([("start", "get y"), ("ok", "craft x")], 1.0, [0.0, 1.0])
    (tmp_path / "rollouts").mkdir()
    log = str(tmp_path / "rollouts" / "step_000001.jsonl")
    with open(log, "w") as f:
        f.write(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    s = anchor_groups.anchor_stats(load_log(log), False, 0.5)
    assert (s["trajectories"], s["groups"], s["turns"]) == (2, 1, 5)
    assert s["shared"] == pytest.approx(4 / 5) and s["later"] == pytest.approx(2 / 3)
    assert s["size"] == 2.0
    assert s["step_nonzero"] == pytest.approx(2 / 5) and s["episode_nonzero"] == 1.0
    # the same two as different groups (another group id): no shared opening, no step signal; a
    # group of one keeps its raw score as its episode advantage (algos' departure 4): B's 1
    b["group"] = 1
    with open(log, "w") as f:
        f.write(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    cmd = [sys.executable, "bench/anchor_groups.py", str(tmp_path), "--gamma", "0.5"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert (row["groups"], row["episode_nonzero"], row["step_nonzero"]) == (2, 0.5, 0.0)
    assert row["shared"] == pytest.approx(2 / 5)  # A's refusal, twice
    with pytest.raises(SystemExit, match="no such trajectory log"):
        anchor_groups.log_files(str(tmp_path / "nope.jsonl"))
