"""A training run's config.json as eval.py's settings.

- `eval.py --checkpoint RUN` plays the run's policy with the run's env, agent, horizon and sampling
  settings (RUN_SETTINGS), except where a flag says otherwise: `take`.
- `eval.py --config RUN/config.json` reads the same file as eval.py's fields, skipping the training
  fields with one note: `from_run`.
"""

from __future__ import annotations

import os

from scheduler import horizons
from trainer.checkpoints import weights_problem
from trainer.cli import read_config

# What a training run's config.json says about how to play its policy: eval.py's fields, by
# train.py's names.
RUN_SETTINGS = ("env", "agent", "max_turns", "max_new_tokens", "max_context", "temperature",
                "top_p")


def from_run(saved: dict) -> tuple[dict, dict]:
    """A train.py config.json as eval.py's fields: the horizon K is the run's evaluation horizon
    (the largest stage of its schedule, or --eval-turns); the run folder is not a result file.
    Returns (fields, {skipped field: why})."""
    saved, skipped = dict(saved), {}
    if "schedule" in saved:  # a training run's config
        saved.setdefault("max_turns", saved.get("eval_turns") or max(horizons(saved["schedule"])))
        if "out" in saved:
            skipped["out"] = "the run folder"
            saved.pop("out")
    return saved, skipped


def checkpoint_model(folder: str) -> str | None:
    """The model folder --checkpoint FOLDER names: a run's RUN/checkpoint/model (checkpoint.old's
    after a crash between a save's two renames), or FOLDER/model where FOLDER is a checkpoint
    itself (RUN/checkpoint); None where there is none."""
    for model in (os.path.join(folder, name, "model") for name in ("checkpoint", "checkpoint.old")):
        if os.path.isdir(model):
            return model
    model = os.path.join(folder, "model")
    return model if os.path.isdir(model) else None


def run_folder(folder: str) -> str:
    """The training run --checkpoint FOLDER belongs to: FOLDER, or the folder holding it where
    FOLDER is a checkpoint itself (its config.json, and the default --out, are the run's)."""
    if checkpoint_model(folder) == os.path.join(folder, "model"):
        return os.path.dirname(os.path.normpath(folder)) or "."
    return folder


def take(p, cfg) -> None:
    """--checkpoint RUN (or RUN/checkpoint): refused without a checkpoint model; RUN/config.json's
    RUN_SETTINGS set on cfg where the command line did not give them (p.given), and named in one
    line."""
    if checkpoint_model(cfg.checkpoint) is None:
        p.error(f"--checkpoint: no checkpoint in {cfg.checkpoint} (expected a run folder, with "
                f"{cfg.checkpoint}/checkpoint/model, or a checkpoint folder, with "
                f"{cfg.checkpoint}/model)")
    if problem := weights_problem(checkpoint_model(cfg.checkpoint)):  # cut short, damaged
        p.error(f"--checkpoint: {problem}")
    path = os.path.join(run_folder(cfg.checkpoint), "config.json")
    if not os.path.exists(path):  # a model folder saved by hand: flags and defaults only
        return
    run, _ = from_run(read_config(p, path, "--checkpoint"))
    taken = {k: run[k] for k in RUN_SETTINGS if k in run and k not in p.given}
    for k, v in taken.items():
        setattr(cfg, k, v)
    if taken:
        print(f"eval.py: from {path}: " + ", ".join(f"{k} {v}" for k, v in taken.items()))
