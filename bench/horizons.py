r"""The paper's horizon comparison: a fixed short horizon, a fixed long one and ScalingInter-RL (the
horizon grows in stages), from the same start, with the same steps, seeds and tasks; held-out
success every few steps; one curves PNG and a table (Markdown and JSON) per comparison.

    python bench/horizons.py --env textcraft --model smollm2-135m --sft "--epochs 1 --lr 1e-4" \
        --train "--batch-size 16 --group-size 8" --horizons 10 30 10,20,30 --steps 30 \
        --eval-every 10 --seeds 0 1 --parallel 6 --device cuda --no-save --out runs/h
    python bench/horizons.py --env corridor --horizons 2 4 2,4 --steps 2 --eval-every 1 --out /tmp/h
        # a CPU smoke run

Each run is `train.py` as a subprocess, up to --parallel of them at once (several runs share one
GPU: a 135M model takes a few GB). With --sft the start is first made by `sft.py --model MODEL --sft
...` (the warm start: behavioural cloning on the env's expert), once, and every run starts from it.
With --model, train.py's real-model defaults apply to every run (lr 1e-6 after 3 warm-up steps, k3
KL 0.001, four mini-batches per step, the 0.01 update_kl guard, dynamic sampling); the SFT recipe
above is the one measured on CPU (1 epoch of the 420 expert trajectories at lr 1e-4), and 16 tasks x
8 samples per step is the paper's batch. The table names the device, each run's wall minutes,
generation tokens/s (rollouts), training tokens/s (the update) and peak GPU memory, and the held-out
success at the first and the last evaluation, as a mean over seeds and per seed. Bring back
OUT/horizons.md, OUT/horizons.json and OUT/horizons.png; the run folders' metrics.jsonl and
eval.jsonl hold the rest (checkpoints are large: --no-save skips them).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from scheduler import horizons  # noqa: E402


def warm_start(a) -> str | None:
    """The model every run starts from: --model itself, or the SFT warm start made from it once."""
    if not a.sft:
        return a.model
    out = os.path.join(a.out, f"warm_{a.env}")
    if not os.path.exists(os.path.join(out, "config.json")):
        cmd = [sys.executable, "-m", "recipes.sft", "--env", a.env, "--out", out,
               *(["--model", a.model] if a.model else []), *a.sft.split()]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def launch(a, model: str | None, schedule: str, seed: int) -> tuple[str, subprocess.Popen]:
    out = os.path.join(a.out, a.env, f"K{schedule.replace(',', '-')}_s{seed}")
    stages = len(horizons(schedule))
    cmd = [sys.executable, "train.py", "--env", a.env, "--schedule", schedule, "--schedule-every",
           str(max(1, -(-a.steps // stages))), "--steps", str(a.steps),
           "--eval-every", str(a.eval_every),
           "--eval-turns", str(max(int(k) for h in a.horizons for k in h.split(","))),
           "--seed", str(seed), "--device", a.device, "--out", out,
           *(["--model", model] if model else []), *a.train.split()]
    if a.no_save:
        cmd += ["--save-every", "-1"]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    log = open(out + ".log", "w")
    print("$", " ".join(cmd[1:]), flush=True)
    return out, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def read(out: str) -> dict:
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = [json.loads(x) for x in open(os.path.join(out, "eval.jsonl"))] if os.path.exists(
        os.path.join(out, "eval.jsonl")) else []
    upd = [r for r in rows if r.get("time_update_s", 0) > 0]
    return {"rows": rows, "evals": evals,
            "gen_tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
            "train_tokens_per_s": sum(r.get("train_tokens", 0) for r in upd)
                                  / max(1e-9, sum(r["time_update_s"] for r in upd)),
            "peak_gpu_mb": max((r.get("peak_gpu_mb", 0.0) for r in rows), default=0.0)}


def device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


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
                   help="no checkpoint at the end (they are large)")
    p.add_argument("--out", default=os.path.join("runs", "horizons"))
    a = p.parse_args()
    for h in a.horizons:  # before any write or launch
        try:
            horizons(h)
        except ValueError as e:
            p.error(f"--horizons {h}: {e}")
    for name in ("steps", "parallel"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    model = warm_start(a)
    todo = [(h, s) for s in a.seeds for h in a.horizons]
    running, done = [], {}
    while todo or running:
        while todo and len(running) < a.parallel:
            h, s = todo.pop(0)
            running.append((h, s, *launch(a, model, h, s)))
        time.sleep(1.0)
        for item in [r for r in running if r[3].poll() is not None]:
            running.remove(item)
            h, s, out, proc = item
            if proc.returncode:
                sys.exit(f"the run {out} failed (exit {proc.returncode}); its log: {out}.log")
            done[(h, s)] = {"out": out, **read(out)}
    minutes = (time.time() - t0) / 60
    report(a, done, model, minutes)


def report(a, done: dict, model, minutes: float) -> None:
    from tools.plot import plot

    runs = [(h, s, done[(h, s)]) for s in a.seeds for h in a.horizons]
    plot([r["out"] for _, _, r in runs], os.path.join(a.out, "horizons.png"),
         labels=[f"K={h} seed {s}" for h, s, _ in runs])
    table = []
    for h in a.horizons:
        per_seed = [done[(h, s)] for s in a.seeds]
        first = [r["evals"][0]["success_rate"] for r in per_seed if r["evals"]]
        last = [r["evals"][-1]["success_rate"] for r in per_seed if r["evals"]]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        table.append({"schedule": h, "seeds": a.seeds, "held_out_start": mean(first),
                      "held_out_end": mean(last), "held_out_end_per_seed": last,
                      "gen_tokens_per_s": mean([r["gen_tokens_per_s"] for r in per_seed]),
                      "train_tokens_per_s": mean([r["train_tokens_per_s"] for r in per_seed]),
                      "peak_gpu_mb": max(r["peak_gpu_mb"] for r in per_seed),
                      "curve": [[e["step"], e["success_rate"]] for e in per_seed[0]["evals"]]})
    head = (f"{a.env}, start: {model or 'the built-in tiny model'}, {a.steps} steps, "
            f"seeds {a.seeds}, device {device_name(a.device)}, {minutes:.1f} min for all "
            f"{len(runs)} runs ({a.parallel} at once)")
    lines = [head, "", "| schedule | held-out start | held-out end (mean) | per seed | "
             "gen tokens/s | train tokens/s | peak GPU MB |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {t['schedule']} | {100 * t['held_out_start']:.1f}% | "
              f"{100 * t['held_out_end']:.1f}% | "
              f"{', '.join(f'{100 * x:.1f}' for x in t['held_out_end_per_seed'])} | "
              f"{t['gen_tokens_per_s']:.0f} | "
              f"{t['train_tokens_per_s']:.0f} | {t['peak_gpu_mb']:.0f} |" for t in table]
    with open(os.path.join(a.out, "horizons.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "horizons.json"), "w") as f:
        json.dump({"env": a.env, "model": model, "device": device_name(a.device), "steps": a.steps,
                   "minutes": minutes, "runs": table}, f, indent=2)
    print("\n".join(lines) + f"\n\nwritten: {a.out}/horizons.md, horizons.json, horizons.png")


if __name__ == "__main__":
    main()
