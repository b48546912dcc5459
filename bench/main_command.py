"""The main commands as the README writes them, and the goal they are held to: held-out success up
at least 20 points over the warm start within 30 minutes of wall time, on the machine at hand.

    python bench/main_command.py                     # TextCraft, then BabyAI
    python bench/main_command.py --env babyai --seed 1

Runs each command (train.py as a subprocess: it builds and caches the warm start first if needed,
which is not counted), reads the run's eval.jsonl and summary.json, and prints per env the held-out
success at step 0 and after the last step, the gain in points, the minutes from the first evaluation
to the end (`minutes` in the summary) and whether both parts of the goal held. Exit status 1 when
one did not. Each run takes about half an hour on 2 cores; this is a benchmark, not a test.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {  # the README's Quick start
    "textcraft": ["--env", "textcraft", "--schedule", "10,20,30"],
    "babyai": ["--env", "babyai", "--schedule", "10,15", "--lr", "3e-4", "--lr-decay", "cosine",
               "--mini-batch-size", "16"],
}
GOAL_POINTS, GOAL_MINUTES = 20.0, 30.0


def run(env: str, seed: int, out: str) -> dict:
    cmd = [sys.executable, "train.py", *COMMANDS[env], "--seed", str(seed), "--out", out]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    # progress: stderr
    done = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="", flush=True)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "eval.jsonl")) as f:
        evals = [json.loads(x) for x in f]
    first, last = evals[0], evals[-1]
    gain = 100 * (last["success_rate"] - first["success_rate"])
    return {"env": env, "seed": seed, "start": first["success_rate"], "end": last["success_rate"],
            "gain": gain, "tasks": last["tasks"], "minutes": summary["minutes"],
            "wall_minutes": (time.time() - t0) / 60,
            "met": gain >= GOAL_POINTS and summary["minutes"] <= GOAL_MINUTES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("runs", "bench_main"),
                   help="parent folder of the runs")
    a = p.parse_args()
    results = []
    for env in a.env:
        out = os.path.join(os.path.abspath(a.out),
                           f"{env}_s{a.seed}_{time.strftime('%Y%m%d-%H%M%S')}")
        results.append(run(env, a.seed, out))
    print(f"\n{'env':<10} {'seed':>4} {'held-out start':>15} {'end':>7} {'gain':>7} "
          f"{'minutes':>8}  goal (+{GOAL_POINTS:g} points in {GOAL_MINUTES:g} min)")
    for r in results:
        print(f"{r['env']:<10} {r['seed']:>4} {100 * r['start']:>14.1f}% {100 * r['end']:>6.1f}% "
              f"{r['gain']:>+7.1f} {r['minutes']:>8.1f}  {'met' if r['met'] else 'NOT met'} "
              f"({r['tasks']} tasks; the whole command took {r['wall_minutes']:.1f} min "
              f"with start-up)")
    sys.exit(0 if all(r["met"] for r in results) else 1)


if __name__ == "__main__":
    main()
