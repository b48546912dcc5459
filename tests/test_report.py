"""--report-to: TensorBoard event files hold every metrics.jsonl field, the held-out evaluations and
the config (read back with tensorboard's own reader); W&B runs offline; a tracker whose package is
missing is one line at parse time, before anything is written. Also --eval-samples: each test task
played n times."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from trainer import report

TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4",
        "--threads", "1", "--schedule", "2", "--steps", "2", "--eval-every", "2",
        "--eval-tasks", "3", "--eval-samples", "2"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def train(args, cache_dir, env=None):
    return subprocess.run([sys.executable, "train.py", *args, "--cache-dir", cache_dir], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def events(folder: str) -> dict:
    """tag -> [(step, value)] of every scalar, and the text entries, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    return out


def test_tensorboard_gets_every_metric_the_evaluations_and_the_config(tmp_path, cache_dir):
    pytest.importorskip("tensorboard",
                        reason="tensorboard is not installed (requirements-test.txt has it)")
    out = tmp_path / "run"
    r = train([*TINY, "--out", str(out), "--report-to", "tensorboard"], cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    got = events(str(out / "tensorboard"))
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)):
                assert ((row["step"], pytest.approx(float(v), rel=1e-6, abs=1e-6))
                        in got[f"train/{k}"]), k
    evals = [json.loads(x) for x in open(out / "eval.jsonl")]
    assert [e["step"] for e in evals] == [0, 2]
    assert [(s, v) for s, v in got["eval/success_rate"]] == \
        [(e["step"], pytest.approx(e["success_rate"])) for e in evals]
    # --eval-samples
    assert evals[-1]["samples"] == 2 and evals[-1]["tasks"] == 3 and evals[-1]["episodes"] == 6
    assert any(k.startswith("eval/by_category/") for k in got)
    (config_tag,) = [k for k in got if k.startswith("config")]
    assert ('"env": "corridor"' in got[config_tag][0][1]
            and '"report_to": "tensorboard"' in got[config_tag][0][1])


def test_wandb_offline_logs_into_the_run_folder(tmp_path, cache_dir):
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install wandb)")
    out = tmp_path / "run"
    r = train([*TINY, "--out", str(out), "--report-to", "wandb"], cache_dir,
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                   **{k: str(tmp_path / "home") for k in (
                       "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR",
                       "XDG_CACHE_HOME")}})
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(out / "wandb" / runs[0]))


def test_wandb_online_without_a_login_is_one_line(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--report-to", "wandb",
                        "--out", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**env, "HOME": str(tmp_path)})  # no ~/.netrc login
    assert (r.returncode == 2 and "WANDB_MODE=offline" in r.stderr
            and len(r.stderr.strip().splitlines()) == 1)
    assert not (tmp_path / "r").exists()


def test_a_wandb_too_old_for_one_run_per_reporter_is_named(monkeypatch):
    """wandb before 0.19.10 has no reinit="create_new": refused at parse time, in one line."""
    real = report.importlib.util.find_spec
    monkeypatch.setattr(report.importlib.util, "find_spec",
                        lambda name: object() if name == "wandb" else real(name))  # "installed"
    monkeypatch.setenv("WANDB_MODE", "offline")
    for version, why in [("0.19.9", "--report-to wandb needs wandb 0.19.10 or newer "
                                    "(reinit=\"create_new\"), not 0.19.9: pip install -U wandb"),
                         ("0.19.10", None), ("0.26.1", None)]:
        monkeypatch.setattr(report.importlib.metadata, "version", lambda name: version)
        assert report.missing("wandb") == why


def test_a_missing_package_is_named_at_parse_time(tmp_path, monkeypatch):
    """A tracker whose package is not installed: one line naming it, from train.py and sft.py, and
    no folder."""
    real = report.importlib.util.find_spec
    monkeypatch.setattr(report.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    assert report.missing("wandb") == ("--report-to wandb needs the wandb package, "
                                       "which is not installed: pip install wandb")
    assert report.missing("none") is None
    hide = tmp_path / "hide"  # a sitecustomize that makes `import tensorboard` fail in the child
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tensorboard':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    for script in (["train.py"], ["-m", "recipes.sft"]):
        out = tmp_path / script[-1]
        r = subprocess.run([sys.executable, *script, "--env", "corridor", "--report-to",
                            "tensorboard", "--out", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), ROOT])})
        assert r.returncode == 2, r.stderr[-2000:]
        assert "--report-to tensorboard needs the tensorboard package" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_sft_reports_its_losses(tmp_path, cache_dir):
    pytest.importorskip("tensorboard",
                        reason="tensorboard is not installed (requirements-test.txt has it)")
    out = tmp_path / "sft"
    r = subprocess.run([sys.executable, "-m", "recipes.sft", "--env", "corridor",
                        "--out", str(out), "--epochs", "1", "--tasks", "0-7", "--threads", "1",
                        "--cache-dir", cache_dir, "--report-to", "tensorboard"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.load(open(out / "sft_summary.json"))
    got = events(str(out / "tensorboard"))
    assert [v for _, v in got["sft/sft_loss"]] == pytest.approx(summary["sft_loss"])
    assert got["sft/trajectories"] == [(0, summary["trajectories"])]
