"""The command lines explain themselves: every default in -h (a % in a help prints as written), a
run folder that already holds a run is refused, the run folder is printed first and a short table
last (every number in summary.json), one-line errors for a missing model folder, an unknown hub
name, an unreachable --env-addr and a taken port, a warning for steps that never reach a stage, and
a run's config.json replayed with --config, flags beside it overriding it."""

import glob
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, exit_of

import train

TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4",
        "--threads", "1", "--schedule", "2", "--steps", "1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


MODULES = {"sft.py": ["-m", "recipes.sft"]}  # scripts that live in a layer run as modules


def run(args, timeout=300, **kw):
    return subprocess.run([sys.executable, *MODULES.get(args[0], args[:1]), *args[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("script", ["train.py", "eval.py", "sft.py"])
def test_help_shows_every_default_and_prints_percent_signs(script):
    r = run([script, "-h"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "(default: textcraft)" in text and "--config FILE" in text
    if script == "train.py":
        assert ("(default: 0.2)" in text and "(default: grpo)" in text
                and "(default: 10,20,30)" in text)
        # the % is printed, not a formatting of vars()
        assert "~30% slower" in text and "{'" not in r.stdout
        assert "dr_grpo" in text  # the estimator choices come from algos.ESTIMATORS


@pytest.mark.parametrize("module", ["recipes.sft", "tools.plot", "tools.viewer"])
def test_a_modules_usage_line_names_the_command_typed(module):
    r = run(["-m", module, "-h"])
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {module} "), r.stdout[:200]


def test_env_server_help_points_to_each_envs_own_flags():
    r = run(["-m", "env_server", "-h"])
    assert r.returncode == 0 and "python -m env_server NAME -h" in r.stdout
    r = run(["-m", "env_server", "searchqa", "-h"])
    text = " ".join(r.stdout.split())
    assert (r.returncode == 0 and "searchqa options" in text and "--topk" in text
            and "(default: 36001)" in text)


def test_a_run_prints_its_folder_first_and_a_table_last(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    r = run(["train.py", *TINY, "--eval-tasks", "4", "--out", out, "--cache-dir", cache_dir])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"run folder: {out}"
    assert ("training success (mean of 1 step)" in r.stdout
            and "held-out success, step 0 -> 1 (4 tasks" in r.stdout)
    assert lines[-1].startswith(f"  every number: {out}/summary.json")
    # the hint works from any folder; transformers' weight-loading bar is not shown
    assert lines[-1].endswith(f"curves: cd {ROOT} && python -m tools.plot {out}")
    assert "Loading weights" not in r.stderr
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["steps"] == 1 and summary["eval_step_end"] == 1
            and "eval_by_category_end" in summary and summary["dtype"] == "float32")
    assert not any(line.startswith("{") for line in lines)  # no JSON dump on the terminal


def test_an_out_folder_holding_a_run_is_refused_without_resume(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    assert run(["train.py", *TINY, "--eval-every", "0", "--out", out,
                "--cache-dir", cache_dir]).returncode == 0
    before = open(os.path.join(out, "metrics.jsonl")).read()
    r = run(["train.py", *TINY, "--eval-every", "0", "--out", out, "--cache-dir", cache_dir])
    assert (r.returncode == 2 and f"--out {out} already holds a run" in r.stderr
            and "--resume" in r.stderr)
    # nothing appended, nothing overwritten
    assert open(os.path.join(out, "metrics.jsonl")).read() == before


def one_line_error(r, needle):
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]  # no traceback


def one_line_refusal(argv, needle, capsys, parse=train.parse_args):
    """one_line_error in this process, for train.parse_args (or `parse`: a script's own), where the
    script checks its flags before anything is written: exit 2, one line on stderr naming
    `needle`."""
    code, _, err = exit_of(lambda: parse(argv), capsys)
    assert code == 2 and needle in err, (argv, err[-2000:])
    assert len(err.strip().splitlines()) == 1, err[-2000:]


def test_a_missing_model_folder_is_one_line_and_leaves_no_run_folder(tmp_path):
    out = tmp_path / "run"
    for script in ("train.py", "eval.py", "sft.py"):
        r = run([script, "--env", "corridor", "--model", str(tmp_path / "no-model"),
                 "--out", str(out)])
        one_line_error(r, f"--model {tmp_path / 'no-model'}: no such folder")
    assert not out.exists()


def test_an_unknown_hub_name_fails_fast_without_waiting_on_the_network(tmp_path):
    t0 = time.time()
    r = run(["train.py", "--env", "corridor", "--model", "no-such-org/no-such-model-3f9a",
             "--out", str(tmp_path / "r")],
            env={**os.environ, "HF_HUB_OFFLINE": "0"})
    one_line_error(r, "--model no-such-org/no-such-model-3f9a: not a local folder, "
                      "not in the Hugging Face cache")
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
    assert (r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
            and "Traceback" not in r.stderr)


def test_fewer_steps_than_stages_warns(capsys):
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "2"])
    err = capsys.readouterr().err
    assert "warning: --steps 2 reaches 2 of the 3 stages of --schedule 10,20,30" in err
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "20",
                      "--schedule-every", "5"])
    assert "reaches 3 of the 3" not in capsys.readouterr().err  # every stage reached: no warning
    train.parse_args(["--env", "corridor", "--schedule", "10,20,30", "--steps", "9",
                      "--schedule-every", "5"])
    assert "reaches 2 of the 3 stages" in capsys.readouterr().err


def test_config_replays_a_run_and_flags_override_it(tmp_path, cache_dir, capsys):
    """A run's config.json replays it, flags beside it overriding it; as it was, its folder holds
    that run (refused, as train.py's user sees it); a file with a field train.py does not have is
    refused in one line (through train.parse_args)."""
    out = tmp_path / "first"
    assert run(["train.py", *TINY, "--eval-every", "0", "--lr", "1e-3", "--out", str(out),
                "--cache-dir", cache_dir]).returncode == 0
    replay = train.parse_args(["--config", str(out / "config.json"),
                               "--out", str(tmp_path / "second"), "--seed", "3"])
    saved = json.load(open(out / "config.json"))
    assert replay.seed == 3 and replay.out == str(tmp_path / "second")
    assert {k: v for k, v in vars(replay).items() if k not in ("seed", "out")} == \
        {k: v for k, v in saved.items() if k not in ("seed", "out")}
    # as it was: its folder holds that run
    r = run(["train.py", "--config", str(out / "config.json")])
    assert r.returncode == 2 and "already holds a run" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"env": "corridor", "learning_rate": 1}))
    one_line_refusal(["--config", str(bad)], "fields this script does not have: learning_rate",
                     capsys)


def test_train_and_test_ids_may_not_overlap(tmp_path):
    """A --tasks-file training list that shares ids with the server's test split is refused:
    held-out numbers on tasks the policy trained on measure memory, not generalisation."""
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([0, 1, 50, 51]))  # corridor's test split is 48-59
    r = run(["train.py", "--env", "corridor", "--tasks-file", str(ids),
             "--out", str(tmp_path / "r")])
    one_line_error(r, f"--tasks-file {ids}: 2 task ids are in both the training and the test split "
                      f"(first: [50, 51])")
    ids.write_text(json.dumps({"train": [0, 1, 2], "test": [2, 48]}))
    one_line_error(run(["train.py", "--env", "corridor", "--tasks-file", str(ids),
                        "--out", str(tmp_path / "r")]),
                   "1 task ids are in both")
    assert not (tmp_path / "r").exists()  # refused before anything is written


def help_text(script, monkeypatch, capsys) -> str:
    """What `script -h` prints, from its parse_args in this process, wrapped as in a pipe (80
    columns; test_help_shows_every_default_and_prints_percent_signs runs each command)."""
    import eval as ev
    from recipes import sft

    parse = {"train.py": train.parse_args, "eval.py": ev.parse_args, "sft.py": sft.parse_args}
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = exit_of(lambda: parse[script](["-h"]), capsys)
    assert code == 0
    return out


def test_help_prints_no_default_the_help_already_states(monkeypatch, capsys):
    for script in ("train.py", "eval.py", "sft.py"):
        text = " ".join(help_text(script, monkeypatch, capsys).split())
        assert "(default: None)" not in text, script
    text = " ".join(help_text("train.py", monkeypatch, capsys).split())
    assert "(default: steps / number of stages) --schedule-kind" in text
    # (-h wraps)
    assert "with --model configs/real-" in text and "(1e-6, the paper's) --out" in text
    assert "(default: 0.0001)" in text  # --critic-lr, whose help says no default


def test_help_lists_the_essential_flags_first_and_the_rest_in_groups(monkeypatch, capsys):
    """-h: the essential flags first (those the three scripts share among them), then named groups;
    a flag the three scripts share is declared once (trainer/cli.py's Shared)."""
    text = help_text("train.py", monkeypatch, capsys)
    groups = [line[:-1] for line in text.splitlines()
              if line and not line.startswith(" ") and line.endswith(":")]
    assert groups[:2] == ["options", "essential flags"] and len(groups) >= 6, groups
    assert text.index("--steps") < text.index("essential flags") + 2000 < text.index("--critic-lr")
    for script in ("train.py", "eval.py", "sft.py"):
        shared = help_text(script, monkeypatch, capsys)
        assert ("seed of task order, noise and sampling" in shared
                and "where built-in models are built" in shared)


def test_resume_continues_with_the_runs_own_config_and_records_the_flags_given(tmp_path, cache_dir,
                                                                              capsys):
    """--resume --out RUN alone is RUN's config (not the defaults: a Corridor run stays Corridor); a
    flag given beside it overrides, and config.json records it; --resume with --config is refused
    in one line (train.parse_args' check)."""
    out = tmp_path / "run"
    args = [*TINY, "--eval-every", "0", "--lr", "1e-3", "--out", str(out), "--cache-dir", cache_dir]
    assert run(["train.py", *args]).returncode == 0
    first = json.load(open(out / "config.json"))
    cfg = train.parse_args(["--resume", "--out", str(out), "--steps", "2"])  # (1: nothing to do)
    assert ({k: v for k, v in vars(cfg).items() if k not in ("resume", "steps")}
            == {k: v for k, v in first.items() if k not in ("resume", "steps")})
    assert cfg.env == "corridor" and cfg.lr == 1e-3 and cfg.resume and cfg.steps == 2
    r = run(["train.py", "--resume", "--out", str(out), "--steps", "2", "--save-every", "-1"])
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.load(open(out / "config.json"))
    assert saved["steps"] == 2 and saved["save_every"] == -1 and saved["env"] == "corridor"
    assert {k: v for k, v in saved.items() if k not in ("steps", "save_every", "resume")} == \
        {k: v for k, v in first.items() if k not in ("steps", "save_every", "resume")}
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2]
    for flags in (["--out", str(out)], []):  # --out given, or --out from the file
        one_line_refusal(["--resume", *flags, "--config", str(out / "config.json")],
                         "--resume continues the run in --out with its own config.json", capsys)
    # a GRPO checkpoint has no critic for PPO to continue
    r = run(["train.py", "--resume", "--out", str(out), "--algo", "ppo", "--steps", "3"])
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "saved without a critic" in r.stderr.strip().splitlines()[-1]


def test_a_single_process_runs_dynamic_sampling_gives_way_under_torchrun(tmp_path, monkeypatch):
    """A --model run's config.json holds dynamic_sampling true (its default in one process);
    resumed or replayed under torchrun it is off, as a fresh torchrun run's default; given as a
    flag there, it is refused."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"env": "corridor", "dynamic_sampling": True, "batch_size": 8}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.parse_args(["--config", str(path)]).dynamic_sampling is False
    r = run(["train.py", "--config", str(path), "--dynamic-sampling"],
            env={**os.environ, "WORLD_SIZE": "2"})
    one_line_error(r, "--dynamic-sampling runs in one process only")


def test_a_config_files_values_are_checked_as_flags_are(tmp_path, capsys):
    """argparse checks the values a command line gives, not the defaults a --config file sets: each
    is checked as its flag would be, in one line; a number for a text flag is read as text. (The
    first bad file as train.py's user sees it, the rest through train.parse_args here.)"""
    good = {"env": "corridor", "steps": 2, "lr": 1, "schedule": 4}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(good))
    cfg = train.parse_args(["--config", str(path)])
    assert (cfg.lr, cfg.schedule, cfg.steps) == (1.0, "4", 2) and isinstance(cfg.lr, float)
    for bad in ({"algo": "bogus"}, {"dynamic_sampling": "false"}, {"batch_size": None},
                {"steps": 2.5}, {"report_to": "bogus"}):
        path.write_text(json.dumps({**good, **bad}))
        field = next(iter(bad))
        needle = (f"{field} = {json.dumps(bad[field])} is not a value --"
                  f"{field.replace('_', '-')} takes")
        if bad == {"algo": "bogus"}:
            one_line_error(run(["train.py", "--config", str(path)]), needle)
        else:
            one_line_refusal(["--config", str(path)], needle, capsys)
    (tmp_path / "a_file").write_text("")
    one_line_refusal(["--env", "corridor", "--out", str(tmp_path / "a_file")], "is a file", capsys)


def test_the_stop_message_names_the_command_that_continues(monkeypatch):
    from trainer.checkpoints import resume_command

    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert resume_command("runs/my run") == "python train.py --resume --out 'runs/my run'"
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resume_command("runs/a") == "torchrun --nproc-per-node 8 train.py --resume --out runs/a"


def test_a_refused_start_writes_nothing_and_the_corrected_one_runs(tmp_path, cache_dir, capsys):
    """train.py refuses a bad start in one line and writes nothing (the task-id overlap as the user
    sees it; the flags out of range through train.parse_args, which train.py runs first); the
    corrected command then runs."""
    out = tmp_path / "run"
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([0, 1, 50]))  # 50 is a Corridor test task
    r = run(["train.py", *TINY, "--tasks-file", str(ids), "--out", str(out),
             "--cache-dir", cache_dir])
    one_line_error(r, "1 task ids are in both the training and the test split")
    assert not (out / "config.json").exists()
    for bad in (["--lr", "-1"], ["--critic-lr", "0"], ["--temperature", "0"], ["--top-p", "0"],
                ["--gamma", "1.5"],
                ["--max-grad-norm", "0"], ["--kl-coef", "-0.1"], ["--eval-samples", "0"]):
        one_line_refusal([*TINY, *bad, "--out", str(out), "--cache-dir", cache_dir],
                         bad[0] + " must be", capsys)
    assert not out.exists()
    r = run(["train.py", *TINY, "--eval-every", "0", "--out", str(out), "--cache-dir", cache_dir])
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_folder_with_only_a_config_is_not_a_run(tmp_path, cache_dir):
    """What an earlier version left after a refused start: config.json alone. It holds no run: a new
    start may use the folder, and --resume says there is no checkpoint, in one line."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"env": "textcraft"}))
    one_line_error(run(["train.py", "--resume", "--out", str(out)]),
                   f"--resume: no checkpoint in {out}")
    cfg = train.parse_args([*TINY, "--out", str(out)])
    assert cfg.out == str(out)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this torch has CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_line(tmp_path):
    for script in ("train.py", "eval.py"):
        r = run([script, "--env", "corridor", "--device", "cuda", "--out", str(tmp_path / script)])
        one_line_error(r, "--device cuda: this torch")
        assert not (tmp_path / script).exists()


def test_sft_refuses_values_that_must_be_positive(tmp_path, capsys):
    """(The first as sft.py's user sees it, the rest through its parse_args, which checks them.)"""
    from recipes import sft

    for bad in (["--lr", "-1"], ["--beta", "0"], ["--temperature", "-1"]):
        argv = ["--env", "corridor", "--out", str(tmp_path / "s"), *bad]
        if bad[0] == "--lr":
            one_line_error(run(["sft.py", *argv]), bad[0] + " must be")
        else:
            one_line_refusal(argv, bad[0] + " must be", capsys, parse=sft.parse_args)
    assert not (tmp_path / "s").exists()


def test_an_env_addr_serving_another_game_is_refused(tmp_path):
    from env_server.app import serve_in_thread, serve_wsgi_in_thread
    from env_server.textcraft import TextCraftEnv
    from flask import Flask

    url, stop = serve_in_thread(TextCraftEnv)
    try:
        for script in ("train.py", "eval.py"):
            r = run([script, "--env", "corridor", "--env-addr", url,
                     "--out", str(tmp_path / script)])
            one_line_error(r, f"--env-addr {url} serves textcraft, not corridor (--env)")
            assert not (tmp_path / script).exists()
    finally:
        stop()
    # AgentGym's servers answer / in plain text, without naming the game
    silent = Flask("agentgym-like")
    silent.get("/")(lambda: "ok")
    url, stop = serve_wsgi_in_thread(silent)
    try:
        from trainer import cli

        cli.check_env_addr(cli.Parser(), url, "corridor")  # accepted: no exit
    finally:
        stop()


def test_the_shipped_configs_are_the_runs_they_name():
    """configs/textcraft-smollm2.json is the real-model headline's run, the third vLLM plan
    (docs/real_model.md): it parses, the settings the plan fixed hold after the real-model defaults,
    and its 34 tasks are training tasks."""
    from env_server.textcraft import load_builtin_world

    cfg = train.parse_args(["--config", os.path.join(ROOT, "configs", "textcraft-smollm2.json")])
    plan = dict(env="textcraft", model="smollm2-135m-sft", schedule="10", steps=10, batch_size=8,
                group_size=4,
                lr=3e-6, warmup_steps=0, mini_batch_size=8, kl_coef=0.001, max_update_kl=0.01,
                dynamic_sampling=True,
                max_resample=1, max_new_tokens=128, max_context=8192, algo="grpo", temperature=1.0)
    assert {k: getattr(cfg, k) for k in plan} == plan
    ids = json.load(open(os.path.join(ROOT, cfg.tasks_file)))
    splits = load_builtin_world().splits
    assert len(ids) == len(set(ids)) == 34 and set(ids) <= set(splits["train"])


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, cache_dir):
    """A finished 2-step Corridor run (a checkpoint at step 2); tests copy it before changing it."""
    out = tmp_path_factory.mktemp("two") / "run"
    r = run(["train.py", *TINY, "--eval-every", "0", "--steps", "2", "--out", str(out),
             "--cache-dir", cache_dir])
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_a_resume_with_nothing_to_do_or_another_game_or_seed_writes_nothing(tmp_path,
                                                                            two_step_run, capsys):
    """--resume with --steps at or below the checkpoint's step says so in one line and exits 0;
    another --env (whose model would be built) or --seed is refused in one line; in each case
    config.json, summary.json and metrics.jsonl stay as they were. (The first as train.py's user
    sees it, the rest through train.parse_args, where train.py makes these checks.)"""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    before = {f: (out / f).read_bytes() for f in ("config.json", "summary.json", "metrics.jsonl")}

    def nothing_to_do(steps):
        return (f"train.py: --resume: the checkpoint in {out} is at step 2 and --steps is {steps}: "
                "nothing to do (a larger --steps extends the run)")

    r = run(["train.py", "--resume", "--out", str(out), "--steps", "1"])
    assert r.returncode == 0 and r.stdout.strip() == nothing_to_do("1"), r.stdout + r.stderr[-2000:]
    code, shown, _ = exit_of(
        lambda: train.parse_args(["--resume", "--out", str(out), "--steps", "2"]), capsys)
    assert code == 0 and shown.strip() == nothing_to_do("2"), shown
    for flags, needle in ((["--env", "textcraft"], "is a run of --env corridor, not textcraft"),
                          (["--seed", "3"], "is a run of --seed 0, not 3")):
        one_line_refusal(["--resume", "--out", str(out), "--steps", "3", *flags],
                         f"--resume: {out} {needle}", capsys)
    assert {f: (out / f).read_bytes() for f in before} == before


def test_summary_minutes_are_the_whole_runs_and_a_changed_batch_is_warned_of(tmp_path,
                                                                             two_step_run):
    """summary.json's minutes after a resume: the run's, every session's (the checkpoint keeps the
    minutes up to it), not the last session's alone. A --batch-size or --group-size other than the
    run's is taken with a one-line warning."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    first = json.load(open(out / "summary.json"))["minutes"]
    t0 = time.time()
    r = run(["train.py", "--resume", "--out", str(out), "--steps", "3", "--batch-size", "4",
             "--group-size", "3"])
    took = (time.time() - t0) / 60
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("train.py: warning: --resume: from step 3 --batch-size 4 (the run's: 2), "
            "--group-size 3 (the run's: 2): the run is no longer the one an unbroken run would "
            "be") in r.stderr
    summary = json.load(open(out / "summary.json"))
    assert summary["steps"] == 3 and first < summary["minutes"] < first + took, (first, summary)


def test_a_checkpoint_folder_is_a_checkpoint_too_for_eval(tmp_path, two_step_run):
    """eval.py --checkpoint RUN/checkpoint plays RUN's checkpoint with RUN's settings and writes
    into RUN, as --checkpoint RUN does."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    r = run(["eval.py", "--checkpoint", str(out / "checkpoint"), "--limit", "2", "--n", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.load(open(out / "eval_test.json"))
    assert result["policy"] == str(out / "checkpoint" / "model") and result["n_scored"] == 1
    assert result["config"]["env"] == "corridor" and result["config"]["max_turns"] == 2


def test_the_real_model_defaults_are_named_when_model_sets_them(model_folder, capsys):
    """--model (a folder SFT made, say) takes configs/real-model.json's defaults: one line names
    each one set, and none that a flag gave; without --model, no line."""
    model = model_folder
    train.parse_args(["--env", "corridor", "--model", str(model), "--lr", "1e-5"])
    err = capsys.readouterr().err
    assert ("train.py: --model: real-model defaults from configs/real-model.json: --kl-coef 0.0, "
            "--warmup-steps 3, --max-update-kl 0.01, --dynamic-sampling, --mini-batch-size 16, "
            "--micro-batch-tokens 4096 (a flag or --config overrides each)\n") in err, err
    train.parse_args(["--env", "corridor"])
    assert "real-model defaults" not in capsys.readouterr().err


def test_a_seed_past_64_bits_and_an_out_under_a_file_are_one_line(tmp_path, capsys):
    """(The seed as train.py's user sees it; the --out through train.parse_args, which checks
    it.)"""
    one_line_error(run(["train.py", "--env", "corridor", "--seed", str(2 ** 64)]),
                   f"--seed {2 ** 64}: a seed must fit in 64 bits")
    (tmp_path / "somefile").write_text("")
    one_line_refusal(["--env", "corridor", "--out", str(tmp_path / "somefile/run")],
                     f"--out {tmp_path / 'somefile/run'}: {tmp_path / 'somefile'} is a file",
                     capsys)


def test_settings_that_learn_nothing_are_refused_or_warned_of(tmp_path, cache_dir, capsys):
    """A group of one: RLOO's baseline is the rest of the group (every advantage 0) and dynamic
    sampling replaces every group (it always ties): refused; GRPO's advantage is then the raw
    score: a warning. A shrinking horizon: a warning. A --max-context the opening prompt alone
    fills (no reply fits after it) is refused once the tokenizer is known, before anything is
    written."""
    for flags, needle in ((["--algo", "rloo"], "--group-size 1 with --algo rloo: "),
                          (["--dynamic-sampling"], "--group-size 1 with --dynamic-sampling: ")):
        with pytest.raises(SystemExit):
            train.parse_args(["--env", "corridor", "--group-size", "1", *flags])
        assert needle in capsys.readouterr().err
    for algo in ("grpo", "gigpo"):
        train.parse_args(["--env", "corridor", "--group-size", "1", "--algo", algo])
        assert (f"warning: --group-size 1 with --algo {algo}: a group of one has no baseline"
                in capsys.readouterr().err)
    train.parse_args(["--env", "corridor", "--schedule", "30,20"])
    assert "warning: --schedule 30,20 shrinks the horizon" in capsys.readouterr().err
    out = tmp_path / "run"
    r = run(["train.py", *TINY, "--max-context", "40", "--out", str(out), "--cache-dir", cache_dir])
    last = r.stderr.strip().splitlines()[-1]  # (after the model's build, where this one builds it)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("--max-context 40: the opening prompt alone is ") and not out.exists()
    assert "no trajectory would reach its first reply" in last


class _NotAnEnvServer:
    """Python's http.server on a thread: a web server, not an env server."""

    def __enter__(self):
        import http.server
        import threading

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                     http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_env_addr_that_is_not_an_env_server_is_named_so(tmp_path):
    with _NotAnEnvServer() as url:
        for script in ("train.py", "eval.py"):
            r = run([script, "--env", "corridor", "--env-addr", url,
                     "--out", str(tmp_path / script)])
            one_line_error(r, f"--env-addr {url} is not an env server of this project: it "
                              "answered 404")
            assert not (tmp_path / script).exists()


def test_ctrl_c_while_the_warm_start_builds_is_one_line(tmp_path):
    """Ctrl-C in the minutes the tiny model's warm start takes to build: exit 130, one line, no
    traceback, no half-built folder in the cache and no run folder."""
    import signal

    cache, out = tmp_path / "cache", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--env", "textcraft", "--threads", "1",
                             "--cache-dir", str(cache), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()  # the random tiny model is built first, in seconds; then its warm start
        while not glob.glob(str(cache / "tiny-textcraft-*" / "config.json")):
            assert proc.poll() is None and time.time() - t0 < 240, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("Ctrl-C: stopped building the tiny model in ")
    assert not [p for p in os.listdir(cache) if ".tmp" in p] and not out.exists()
