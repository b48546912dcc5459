r"""The two mechanisms the horizon claim rests on, read from a finished horizon study's run folders
(`python -m recipes.horizons ... --out OUT`):

    python bench/horizon_mechanisms.py OUT --early 20 --short 2 --long 12

- The ceiling: each arm's training success by task category (for Corridor the goal's distance),
  seeds pooled, over the first --early steps and the last --early steps, from the trajectories the
  runs logged (RUN/rollouts/). A category the short horizon cannot reach reads 0 there.
- Early harm of the long horizon: held-out success after step --early (train.py's evaluation, the
  study's one horizon, the same tasks), the long arm minus the short arm seed by seed, its mean and
  95% Student t interval; and training success over steps 1..--early, per arm (not comparable
  across horizons: a longer one gives more tries).
- What the ends learned: per arm, the runs whose final checkpoint (RUN/eval_end.json) solves every
  held-out task at least once in its samples; on Corridor a policy that walks one way solves half
  the tasks (the goals on its side) and no other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from env_server.agents import env_spec, server_class  # noqa: E402
from recipes.horizons_report import end_result, mean, rows, run_name, t_interval  # noqa: E402


def by_category(run: str, steps: range, category) -> dict:
    """Training success per task category over `steps` of one run: [successes, episodes]."""
    out = defaultdict(lambda: [0, 0])
    for step in steps:
        path = os.path.join(run, "rollouts", f"step_{step:06d}.jsonl")
        for t in rows(path):
            if t["status"] == "env_error":
                continue
            c = out[category(t["item_id"])]
            c[0] += t["status"] == "done" and t["reward"] > 0
            c[1] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the study's folder")
    p.add_argument("--early", type=int, default=20, help="the early window, in steps")
    p.add_argument("--short", required=True, help="the short fixed arm, as in --arms")
    p.add_argument("--long", required=True, help="the long fixed arm, as in --arms")
    a = p.parse_args()
    study = json.load(open(os.path.join(a.out, "horizons.json")))
    cls = server_class(env_spec(study["env"]))
    world = cls.load_world(None)
    seeds, steps = study["seeds"], study["steps"]
    print(f"training success by category, seeds {seeds} pooled: steps 1-{a.early} | "
          f"{steps - a.early + 1}-{steps}")
    for arm in [t["arm"] for t in study["arms"]]:
        for name, window in (("first", range(1, a.early + 1)),
                             ("last", range(steps - a.early + 1, steps + 1))):
            total = defaultdict(lambda: [0, 0])
            for s in seeds:
                got = by_category(os.path.join(a.out, run_name(arm, s)), window,
                                  lambda i: cls.task_category(world, i))
                for c, (k, n) in got.items():
                    total[c][0] += k
                    total[c][1] += n
            cells = ", ".join(f"{c} {100 * k / n:.1f}% ({n})"
                              for c, (k, n) in sorted(total.items()))
            print(f"  K={arm}, {name}: {cells}")
    early = {}
    for arm in (a.short, a.long):
        early[arm] = []
        for s in seeds:
            path = os.path.join(a.out, run_name(arm, s), "eval.jsonl")
            evals = {e["step"]: e for e in rows(path)}
            early[arm].append(evals[a.early]["success_rate"])
    diffs = [y - x for x, y in zip(early[a.short], early[a.long])]
    ci = t_interval(diffs)[1]
    shown = f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else ""
    print(f"held-out after step {a.early}: K={a.short} {100 * mean(early[a.short]):.1f}%, "
          f"K={a.long} {100 * mean(early[a.long]):.1f}%; K={a.long} minus K={a.short}, by seed: "
          f"{100 * mean(diffs):+.1f}{shown} ({len(diffs)} seeds)")
    for arm in (a.short, a.long):
        xs = [mean([r["success_rate"] for r in rows(os.path.join(a.out, run_name(arm, s),
                                                                  "metrics.jsonl"))[:a.early]])
              for s in seeds]
        print(f"training success, steps 1-{a.early}, K={arm}: {100 * mean(xs):.1f}% "
              f"(seeds: {', '.join(f'{100 * x:.1f}' for x in xs)})")
    for arm in [t["arm"] for t in study["arms"]]:
        ends = [end_result(os.path.join(a.out, run_name(arm, s))) for s in seeds]
        every = [s for s, e in zip(seeds, ends)
                 if e and all(max(t["scores"]) > 0 for t in e["tasks"])]
        print(f"the end solves every held-out task at least once, K={arm}: {len(every)} of "
              f"{len(seeds)} seeds ({', '.join(map(str, every)) or 'none'})")


if __name__ == "__main__":
    main()
