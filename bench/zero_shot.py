"""A zero-shot table in the paper's style: eval.py on each environment's test split, for each model,
with Avg@n and Pass@n, the command behind every row, and the minutes it took on this machine.

    python bench/zero_shot.py                       # SmolLM2-135M-Instruct and the tiny warm starts
    python bench/zero_shot.py --models smollm2-135m --envs textcraft --tasks 0 --n 4
    python bench/zero_shot.py --out docs/zero_shot  # writes zero_shot.md and zero_shot.json

Settings follow the paper's evaluation where they can (temperature 1, the largest horizon of each
env's ScalingInter-RL schedule); --tasks spreads a subset over the split when the whole one costs
too much on CPU (0: all of it), and the table says how many tasks each row played. `tiny` is the
built-in tiny model (warm-started for TextCraft, BabyAI and Corridor; random weights elsewhere,
which never write an action).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the schedules' largest K
HORIZONS = {"textcraft": 30, "babyai": 20, "sciworld": 30, "searchqa": 10}
EXTRA = {"sciworld": ["--batch", "16"]}  # one JVM per instance


def row(env: str, model: str, tasks: int, n: int, max_new_tokens: int, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{env}_{model}.json")
    ids = os.path.join(out_dir, f"{env}_ids.json")
    cmd = ["eval.py", "--env", env, "--n", str(n), "--max-turns", str(HORIZONS[env]),
           "--max-new-tokens", str(max_new_tokens), "--max-context", "8192", "--out", out,
           *EXTRA.get(env, [])]
    if tasks:
        cmd += ["--tasks-file", ids]
    if model != "tiny":
        cmd += ["--model", model]
    print("$ python", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    res = json.load(open(out))
    k = res["n_scored"]
    return {"env": env, "model": model, "tasks": res["overall"]["tasks"], "n": k,
            "avg": res["overall"][f"avg@{k}"], "pass": res["overall"][f"pass@{k}"],
            "excluded": sum(res["excluded"].values()), "minutes": (time.time() - t0) / 60,
            "command": "python " + " ".join(c if not c.startswith(out_dir) else os.path.basename(c)
                                            for c in cmd)}


def spread_test_ids(env: str, k: int, path: str) -> None:
    """The first k of the test split spread evenly (as train.py's held-out evaluation picks
    them)."""
    sys.path.insert(0, ROOT)
    from tasks import spread
    from env_server import get_env_class

    cls = get_env_class(env)
    with open(path, "w") as f:
        json.dump({"test": spread(cls.splits(cls.load_world(None))["test"], k)}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny"])
    p.add_argument("--envs", nargs="+", default=list(HORIZONS), choices=list(HORIZONS))
    p.add_argument("--tasks", type=int, default=26,
                   help="test tasks per env, spread over the split (0: all)")
    p.add_argument("--n", type=int, default=1, help="samples per task (Avg@n, Pass@n)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None,
                   help="folder for zero_shot.md and zero_shot.json (default: a temp folder)")
    a = p.parse_args()
    out_dir = os.path.abspath(a.out or tempfile.mkdtemp(prefix="zero_shot_"))
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for env in a.envs:
        if a.tasks:
            spread_test_ids(env, a.tasks, os.path.join(out_dir, f"{env}_ids.json"))
        for model in a.models:
            rows.append(row(env, model, a.tasks, a.n, a.max_new_tokens, out_dir))
    n = a.n
    lines = [f"| env | model | test tasks | K | Avg@{n} | Pass@{n} | excluded (errors) | minutes |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['env']} | {r['model']} | {r['tasks']} | {HORIZONS[r['env']]} | "
              f"{100 * r['avg']:.1f} | {100 * r['pass']:.1f} | {r['excluded']} | "
              f"{r['minutes']:.1f} |" for r in rows]
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "zero_shot.md"), "w") as f:
        f.write(table + "\n\nCommands:\n\n" + "\n".join(f"    {r['command']}" for r in rows) + "\n")
    with open(os.path.join(out_dir, "zero_shot.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print("\n" + table + f"\n\nwritten to {out_dir}/zero_shot.md and zero_shot.json")


if __name__ == "__main__":
    main()
