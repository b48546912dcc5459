"""The command lines explain themselves: every default in -h (a % in a help prints as written), a run
folder that already holds a run is refused, the run folder is printed first and a short table last
(every number in summary.json), one-line errors for a missing model folder, an unknown hub name, an
unreachable --env-addr and a taken port, a warning for steps that never reach a stage, and a run's
config.json replayed with --config, flags beside it overriding it."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT

import train

TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--threads", "1",
        "--schedule", "2", "--steps", "1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run(args, timeout=300, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("script", ["train.py", "eval.py", "sft.py"])
def test_help_shows_every_default_and_prints_percent_signs(script):
    r = run([script, "-h"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "(default: textcraft)" in text and "--config FILE" in text
    if script == "train.py":
        assert "(default: 0.2)" in text and "(default: grpo)" in text and "(default: 10,20,30)" in text
        assert "~30% slower" in text and "{'" not in r.stdout  # the % is printed, not a formatting of vars()
        assert "dr_grpo" in text  # the estimator choices come from algos.ESTIMATORS


def test_env_server_help_points_to_each_envs_own_flags():
    r = run(["-m", "env_server", "-h"])
    assert r.returncode == 0 and "python -m env_server NAME -h" in r.stdout
    r = run(["-m", "env_server", "searchqa", "-h"])
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "searchqa options" in text and "--topk" in text and "(default: 36001)" in text


def test_a_run_prints_its_folder_first_and_a_table_last(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    r = run(["train.py", *TINY, "--eval-tasks", "4", "--out", out, "--cache-dir", cache_dir])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"run folder: {out}"
    assert "training success (mean of 1 steps)" in r.stdout and "held-out success, step 0 -> 1 (4 tasks" in r.stdout
    assert lines[-1].startswith(f"  every number: {out}/summary.json")
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 1 and summary["eval_step_end"] == 1 and "eval_by_category_end" in summary
    assert not any(line.startswith("{") for line in lines)  # no JSON dump on the terminal


def test_an_out_folder_holding_a_run_is_refused_without_resume(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    assert run(["train.py", *TINY, "--eval-every", "0", "--out", out, "--cache-dir", cache_dir]).returncode == 0
    before = open(os.path.join(out, "metrics.jsonl")).read()
    r = run(["train.py", *TINY, "--eval-every", "0", "--out", out, "--cache-dir", cache_dir])
    assert r.returncode == 2 and f"--out {out} already holds a run" in r.stderr and "--resume" in r.stderr
    assert open(os.path.join(out, "metrics.jsonl")).read() == before  # nothing appended, nothing overwritten


def one_line_error(r, needle):
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]  # no traceback


def test_a_missing_model_folder_is_one_line_and_leaves_no_run_folder(tmp_path):
    out = tmp_path / "run"
    for script in ("train.py", "eval.py", "sft.py"):
        r = run([script, "--env", "corridor", "--model", str(tmp_path / "no-model"), "--out", str(out)])
        one_line_error(r, f"--model {tmp_path / 'no-model'}: no such folder")
    assert not out.exists()


def test_an_unknown_hub_name_fails_fast_without_waiting_on_the_network(tmp_path):
    t0 = time.time()
    r = run(["train.py", "--env", "corridor", "--model", "no-such-org/no-such-model-3f9a", "--out", str(tmp_path / "r")],
            env={**os.environ, "HF_HUB_OFFLINE": "0"})
    one_line_error(r, "--model no-such-org/no-such-model-3f9a: not a local folder, not in the Hugging Face cache")
    assert time.time() - t0 < 40 and not (tmp_path / "r").exists()
    r = run(["train.py", "--env", "corridor", "--model", "no-such-org/no-such-model-3f9a"],
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    one_line_error(r, "(HF_HUB_OFFLINE is set)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_env_addr_is_one_line(tmp_path):
    addr = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for script in ("train.py", "eval.py"):
        r = run([script, "--env", "corridor", "--env-addr", addr, "--out", str(tmp_path / script)])
        one_line_error(r, f"--env-addr {addr}: no env server answers there")
        assert not (tmp_path / script).exists()


def test_a_taken_port_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run(["-m", "env_server", "corridor", "--port", str(port)], timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_fewer_steps_than_stages_warns(capsys):
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "2"])
    err = capsys.readouterr().err
    assert "warning: --steps 2 reaches 2 of the 3 stages of --schedule 10,20,30" in err
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "20", "--schedule-every", "5"])
    assert "reaches 3 of the 3" not in capsys.readouterr().err  # every stage reached: no warning
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "9", "--schedule-every", "5"])
    assert "reaches 2 of the 3 stages" in capsys.readouterr().err


def test_config_replays_a_run_and_flags_override_it(tmp_path, cache_dir):
    out = tmp_path / "first"
    assert run(["train.py", *TINY, "--eval-every", "0", "--lr", "1e-3", "--out", str(out), "--cache-dir",
                cache_dir]).returncode == 0
    replay = train.parse_args(["--config", str(out / "config.json"), "--out", str(tmp_path / "second"), "--seed", "3"])
    saved = json.load(open(out / "config.json"))
    assert replay.seed == 3 and replay.out == str(tmp_path / "second")
    assert {k: v for k, v in vars(replay).items() if k not in ("seed", "out")} == \
        {k: v for k, v in saved.items() if k not in ("seed", "out")}
    r = run(["train.py", "--config", str(out / "config.json")])  # as it was: its folder holds that run
    assert r.returncode == 2 and "already holds a run" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"env": "corridor", "learning_rate": 1}))
    r = run(["train.py", "--config", str(bad)])
    one_line_error(r, "fields this script does not have: learning_rate")


def test_train_and_test_ids_may_not_overlap(tmp_path):
    """A --tasks-file training list that shares ids with the server's test split is refused: held-out
    numbers on tasks the policy trained on measure memory, not generalisation."""
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([0, 1, 50, 51]))  # corridor's test split is 48-59
    r = run(["train.py", "--env", "corridor", "--tasks-file", str(ids), "--out", str(tmp_path / "r")])
    one_line_error(r, f"--tasks-file {ids}: 2 task ids are in both the training and the test split (first: [50, 51])")
    ids.write_text(json.dumps({"train": [0, 1, 2], "test": [2, 48]}))
    one_line_error(run(["train.py", "--env", "corridor", "--tasks-file", str(ids)]), "1 task ids are in both")
