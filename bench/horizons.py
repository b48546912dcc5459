r"""The paper's horizon comparison with an SFT warm start: a thin wrapper of `python -m
recipes.horizons` (the study itself: runs, resume, progress, figure, tables, paired end comparison)
that keeps this script's flags and adds one step, the warm start.

    python bench/horizons.py --env textcraft --model smollm2-135m --sft "--epochs 1 --lr 1e-4" \
        --train "--batch-size 16 --group-size 8" --horizons 10 30 10,20,30 --steps 30 \
        --eval-every 10 --seeds 0 1 --parallel 6 --device cuda --no-save --out runs/h
    python bench/horizons.py --env corridor --horizons 2 4 2,4 --steps 2 --eval-every 1 --out /tmp/h
        # a CPU smoke run

With --sft the start is first made by `recipes.sft --model MODEL --sft ...` (behavioural cloning on
the env's expert) into OUT/warm_ENV, once, and every run starts from it. With --model, train.py's
real-model defaults apply to every run (lr 1e-6 after 3 warm-up steps, no KL term, four
mini-batches per step, the 0.01 update_kl guard, dynamic sampling); the SFT recipe above is the one
measured on CPU (1 epoch of the 420 expert trajectories at lr 1e-4), and 16 tasks x 8 samples per
step is the paper's batch. The flags map onto the recipe's: --horizons is --arms, --train and
--device go to every run after `--`, --no-save is `--save-every -1` (no checkpoints: smaller, but a
cut run restarts from scratch and the paired end comparison is left out). The runs are OUT/K10_s0
and so on (OUT/ENV/... before this script became a wrapper); the same command continues a cut study.
Bring back OUT/horizons.md, OUT/horizons.json and OUT/horizons.png; the run folders' metrics.jsonl
and eval.jsonl hold the rest.
"""

import argparse
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from recipes import horizons as recipe  # noqa: E402


def warm_path(a) -> str:
    return os.path.join(os.path.abspath(a.out), f"warm_{a.env}")


def warm_start(a) -> str | None:
    """The model every run starts from: --model itself, or the SFT warm start made from it once."""
    if not a.sft:
        return a.model
    out = warm_path(a)
    if not os.path.exists(os.path.join(out, "config.json")):
        cmd = [sys.executable, "-m", "recipes.sft", "--env", a.env, "--out", out,
               *(["--model", a.model] if a.model else []), *shlex.split(a.sft)]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def study_argv(a, model: str | None) -> list[str]:
    """This script's flags as recipes.horizons takes them."""
    return ["--env", a.env, "--arms", *a.horizons, "--steps", str(a.steps),
            "--eval-every", str(a.eval_every), "--seeds", *map(str, a.seeds),
            "--parallel", str(a.parallel), "--out", a.out, "--", "--device", a.device,
            *(["--model", model] if model else []), *shlex.split(a.train),
            *(["--save-every", "-1"] if a.no_save else [])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="textcraft")
    p.add_argument("--model", default=None,
                   help="a built-in name, an HF folder, or absent: the tiny model")
    p.add_argument("--sft", default="",
                   help="sft.py flags that make the warm start from --model (absent: none)")
    p.add_argument("--horizons", nargs="+", default=["10", "30", "10,20,30"],
                   help="one --schedule per run kind")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--parallel", type=int, default=3, help="runs at once")
    p.add_argument("--device", default="auto")
    p.add_argument("--train", default="",
                   help="more train.py flags for every run, e.g. '--lr 1e-5 --batch-size 16'")
    p.add_argument("--no-save", action="store_true",
                   help="no checkpoints (they are large); no resume, no paired end comparison")
    p.add_argument("--out", default=os.path.join("runs", "horizons"))
    a = p.parse_args()
    # every check of the study before the warm start is built (the warm start, once it exists)
    model = warm_path(a) if a.sft and os.path.isdir(warm_path(a)) else a.model
    recipe.parse_args(study_argv(a, model))
    recipe.main(study_argv(a, warm_start(a)))


if __name__ == "__main__":
    main()
