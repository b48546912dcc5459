"""A hurried user's command is refused in one line before anything is written, or warned of:
an --out that is empty or cannot be written in, a folder that is not a model, a damaged or
foreign checkpoint on --resume, a folder a stopped run left, coefficients that are NaN, a
negative --threads, a --cache-dir under a file."""

import json
import os
import shutil

import pytest

import train
from test_cli import TINY, one_line_refusal, run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 1-step Corridor run; tests copy it before changing it."""
    base = tmp_path_factory.mktemp("finished")
    out = base / "run"
    r = run(["train.py", *TINY, "--eval-every", "0", "--out", str(out),
             "--cache-dir", str(base / "cache")])
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_an_out_that_is_empty_or_cannot_be_written_is_refused_first(read_only_dir, capsys):
    """Refused with the flags, not after the models load (a traceback then)."""
    one_line_refusal(["--env", "corridor", "--out", ""], "--out is empty", capsys)
    out = os.path.join(read_only_dir, "run")
    one_line_refusal(["--env", "corridor", "--out", out],
                     f"--out {out}: {read_only_dir} cannot be written in", capsys)
    assert os.listdir(read_only_dir) == []


def test_a_folder_that_is_not_a_model_is_refused_by_each_script(finished_run, tmp_path, capsys):
    """A run folder given as --model (its config.json holds the run's flags) names the model
    inside it; an empty folder says what a model folder holds."""
    import eval as evaluation
    from recipes import sft

    empty = tmp_path / "empty"
    empty.mkdir()
    for parse in (train.parse_args, evaluation.parse_args, sft.parse_args):
        out = ["--out", str(tmp_path / "sft")] if parse is sft.parse_args else []
        one_line_refusal(["--env", "corridor", "--model", str(finished_run), *out],
                         f"--model {finished_run}: not a model folder (a run folder: its model "
                         f"is {finished_run / 'checkpoint' / 'model'})", capsys, parse=parse)
        one_line_refusal(["--env", "corridor", "--model", str(empty), *out],
                         f"--model {empty}: not a model folder", capsys, parse=parse)


def test_a_resume_from_a_damaged_or_foreign_checkpoint_is_one_line(finished_run, tmp_path,
                                                                   capsys):
    """A trainer state or weights file cut short (eval.py's --checkpoint too), another --model:
    refused before anything is written; another --algo: a warning (no longer one run's)."""
    def copy(name):
        shutil.copytree(finished_run, tmp_path / name)
        return tmp_path / name

    args = ["--resume", "--steps", "2", "--out"]
    out = copy("state")
    (out / "checkpoint" / "trainer_state.pt").write_bytes(b"PK\x03\x04cut")
    one_line_refusal([*args, str(out)], f"--resume: {out / 'checkpoint' / 'trainer_state.pt'} "
                     "cannot be read: RuntimeError:", capsys)
    out = copy("weights")
    weights = out / "checkpoint" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    one_line_refusal([*args, str(out)], f"--resume: {weights} cannot be read:", capsys)
    import eval as evaluation
    one_line_refusal(["--checkpoint", str(out), "--limit", "1"],
                     f"--checkpoint: {weights} cannot be read:", capsys,
                     parse=evaluation.parse_args)
    out = copy("foreign")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    one_line_refusal([*args, str(out), "--model", str(model)],
                     f"--resume: {out} is a run of the tiny model, not {model}", capsys)
    before = (out / "config.json").read_text()
    train.parse_args([*args, str(out), "--algo", "rloo"])
    assert "warning: --resume: from step 2 --algo rloo (the run's: grpo)" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before


def test_a_log_line_that_is_not_a_step_is_one_line_on_resume(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n")
    r = run(["train.py", "--resume", "--steps", "2", "--out", str(out)])
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{out / 'metrics.jsonl'}:2 is not a step's line" in r.stderr.strip().splitlines()[-1]


def test_a_folder_a_run_left_before_its_first_checkpoint_is_not_run_into(tmp_path, capsys):
    """A run stopped in step 1 leaves the step-0 evaluation: another run there would append to
    it, and a later --resume read it as its start."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "eval.jsonl").write_text(json.dumps({"step": 0, "success_rate": 0.5}) + "\n")
    one_line_refusal(["--env", "corridor", "--out", str(out)],
                     f"--out {out} holds a run stopped before its first checkpoint (eval.jsonl)",
                     capsys)


def test_nan_coefficients_negative_threads_and_a_cache_under_a_file_are_refused(tmp_path,
                                                                                capsys):
    """A NaN --entropy-coef made the loss NaN and the checkpoint's weights with it."""
    import eval as evaluation

    for flag in ("--entropy-coef", "--step-adv-weight"):
        one_line_refusal(["--env", "corridor", flag, "nan"], f"{flag} must be 0 or more",
                         capsys)
    one_line_refusal(["--env", "corridor", "--threads", "-1"], "--threads must be 0 or more",
                     capsys, parse=evaluation.parse_args)
    (tmp_path / "afile").write_text("")
    cache = tmp_path / "afile" / "cache"
    one_line_refusal(["--env", "corridor", "--cache-dir", str(cache)],
                     f"--cache-dir {cache}: {tmp_path / 'afile'} is a file", capsys)
