"""The horizon study's report (`python -m recipes.horizons`, at its end), read from the run folders
alone: OUT/horizons.png, and one table in OUT/horizons.md and OUT/horizons.json.

- Held-out success: each run's eval.jsonl (train.py's evaluations, every --eval-every steps, at the
  study's one evaluation horizon on the same tasks); an arm's curve is the mean over seeds at the
  steps every seed evaluated, its band the min-max over seeds.
- Chance: each run's first evaluation plays a random policy on the same tasks and horizon
  (eval.jsonl's `chance`); the study's is their mean, a dashed line in the figure, and a study in
  which no arm ends above it is called uninformative.
- Training success: each run's metrics.jsonl, mean over seeds per step; in the figure a trailing
  mean over WINDOW steps (faint: per step); in the table the mean of the first and of the last k
  steps, k = min(5, steps / 2), as train.py's summary takes them.
- Minutes: the logged times of the steps (rollout, update, weight sync) and of the evaluations, so
  that a run resumed after a stop counts each step once; start-up and checkpoint writes are left
  out.
- The paired end comparison: eval.py's per-task result of each final checkpoint (RUN/eval_end.json,
  the curves' held-out tasks), each arm with more than one horizon against each fixed one, seeds
  pooled (a task's score: its mean over every sample of every seed), tools/paired.compare's mean
  per-task change and 95% normal interval.
"""

from __future__ import annotations

import json
import math
import os

from scheduler import horizons, stage_steps
from tools import paired

WINDOW = 5  # steps of the trailing mean of the training-success panel
# Student t's 97.5% point by degrees of freedom (any statistics table); 1.96 beyond 30
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060,
        2.056, 2.052, 2.048, 2.045, 2.042]


def run_name(arm: str, seed: int) -> str:
    """The run folder's name: K5_s0, K5-10-20_s1."""
    return f"K{arm.replace(',', '-')}_s{seed}"


def label(arm: str) -> str:
    ks = horizons(arm)
    return f"K={ks[0]}" if len(ks) == 1 else f"K={'->'.join(map(str, ks))} (ScalingInter-RL)"


def rows(path: str) -> list[dict]:
    """The lines of a JSONL file a run writes; a last line still being written is left out."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def trailing_mean(xs: list[float], window: int) -> list[float]:
    return [mean(xs[max(0, i + 1 - window):i + 1]) for i in range(len(xs))]


def end_result(out: str) -> dict | None:
    """RUN/eval_end.json, eval.py's per-task result of the final checkpoint, or None."""
    r = paired.read_result(os.path.join(out, "eval_end.json"))
    return None if isinstance(r, str) else r


def end_avg(out: str) -> float | None:
    """The final checkpoint's held-out Avg@n (RUN/eval_end.json), or None."""
    r = end_result(out)
    return None if r is None else sum(
        sum(t["scores"]) / len(t["scores"]) for t in r["tasks"]) / len(r["tasks"])


def by_seed(a, arm: str, base: str) -> dict:
    """The arm's end minus the fixed arm's, seed by seed: the mean over the seeds that both have,
    and its 95% Student t interval."""
    seeds, diffs = [], []
    for s in a.seeds:
        x, y = (end_avg(os.path.join(a.out, run_name(k, s))) for k in (arm, base))
        if x is not None and y is not None:
            seeds.append(s)
            diffs.append(x - y)
    sd, ci95 = t_interval(diffs)
    return {"seeds": seeds, "differences": diffs, "change": mean(diffs), "sd": sd, "ci95": ci95}


def t_interval(xs: list[float]) -> tuple:
    """The standard deviation of `xs` and the 95% Student t interval of their mean (n - 1
    degrees of freedom); (None, None) for fewer than two."""
    n, m = len(xs), mean(xs)
    if n < 2:
        return None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return sd, [m - half, m + half]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def stat(xs: list[float]) -> dict:
    return {"mean": mean(xs), "per_seed": xs}


def read_run(out: str) -> dict:
    m = rows(os.path.join(out, "metrics.jsonl"))
    evals = [e for e in rows(os.path.join(out, "eval.jsonl")) if e["tasks"]]  # 0: the env failed
    k = max(1, min(5, len(m) // 2))
    seconds = (sum(v for r in m for key, v in r.items()
                   if key.startswith("time_") and key.endswith("_s") and v)
               + sum(e.get("time_s", 0.0) for e in evals))
    upd = [r for r in m if r.get("time_update_s", 0) > 0]
    return {"evals": {e["step"]: e for e in evals},
            "chance": next((e["chance"] for e in evals if e.get("chance") is not None), None),
            "train": {r["step"]: r["success_rate"] for r in m},
            "turns": {r["step"]: r.get("turns_mean") for r in m},
            "first": mean([r["success_rate"] for r in m[:k]]), "k": k,
            "last": mean([r["success_rate"] for r in m[-k:]]), "minutes": seconds / 60,
            "gen_tokens_per_s": mean([r["tokens_per_s"] for r in m]),
            "train_tokens_per_s": sum(r.get("train_tokens", 0) for r in upd)
                                  / max(1e-9, sum(r["time_update_s"] for r in upd)),
            "peak_gpu_mb": max((r.get("peak_gpu_mb", 0.0) for r in m), default=0.0)}


def arm_row(a, arm: str) -> dict:
    """One arm's line of the table, and its curves, over its seeds."""
    seeds = [s for s in a.seeds if run_name(arm, s) not in getattr(a, "damaged", ())]
    runs = [read_run(os.path.join(a.out, run_name(arm, s))) for s in seeds]
    shared = sorted(set.intersection(*(set(r["evals"]) for r in runs))) if runs else []
    curve = []
    for step in shared:
        xs = [r["evals"][step]["success_rate"] for r in runs]
        curve.append({"step": step, "mean": mean(xs), "min": min(xs), "max": max(xs),
                      "per_seed": xs})
    steps = sorted(set.intersection(*(set(r["train"]) for r in runs))) if runs else []
    ends = [end_result(os.path.join(a.out, run_name(arm, s))) for s in seeds]
    return {"arm": arm, "label": label(arm), "seeds": seeds,
            "runs": [run_name(arm, s) for s in seeds],
            "held_out_first": {"step": curve[0]["step"], **stat(curve[0]["per_seed"])}
            if curve else None,
            "held_out_last": {"step": curve[-1]["step"], **stat(curve[-1]["per_seed"])}
            if curve else None,
            "held_out_tasks": next(iter(runs[0]["evals"].values()), {}).get("tasks", 0)
            if runs else 0,
            # a random policy's held-out success on the same tasks and K (None: the game
            # defines none)
            "chance": mean([r["chance"] for r in runs if r["chance"] is not None]) if any(
                r["chance"] is not None for r in runs) else None,
            "train_success_steps": runs[0]["k"] if runs else 0,
            "train_success_first": stat([r["first"] for r in runs]),
            "train_success_last": stat([r["last"] for r in runs]),
            "minutes": stat([r["minutes"] for r in runs]),
            "end_eval": stat([next(v for key, v in e["overall"].items() if key.startswith("avg@"))
                              for e in ends if e]),
            "gen_tokens_per_s": mean([r["gen_tokens_per_s"] for r in runs]),
            "train_tokens_per_s": mean([r["train_tokens_per_s"] for r in runs]),
            "peak_gpu_mb": max((r["peak_gpu_mb"] for r in runs), default=0.0),
            "curve": curve,
            "train_curve": [[s, mean([r["train"][s] for r in runs])] for s in steps],
            "turns_curve": [[s, mean([r["turns"][s] for r in runs])] for s in steps
                            if all(r["turns"][s] is not None for r in runs)]}


def paired_ends(a) -> tuple[list[dict], str]:
    """Each arm with more than one horizon against each fixed arm, at the end, task by task (seeds
    pooled); and a line that says what was compared, or why nothing was."""
    staged = [arm for arm in a.arms if len(horizons(arm)) > 1]
    fixed = [arm for arm in a.arms if len(horizons(arm)) == 1]
    ends = {arm: [(s, os.path.join(a.out, run_name(arm, s), "eval_end.json")) for s in a.seeds
                  if end_result(os.path.join(a.out, run_name(arm, s)))] for arm in a.arms}
    if not (staged and fixed):
        return [], ("no paired comparison: it needs an arm with more than one horizon and a "
                    "fixed one")
    if not any(ends.values()):
        return [], ("no paired comparison: no run has an end evaluation (RUN/eval_end.json needs "
                    "the final checkpoint, which --save-every -1 leaves out)")
    out = []
    for arm in staged:
        for base in fixed:
            if not (ends[arm] and ends[base]):
                continue
            c = paired.compare(paired.pooled([p for _, p in ends[base]]),
                               paired.pooled([p for _, p in ends[arm]]))
            out.append({"arm": arm, "against": base, "seeds": [s for s, _ in ends[arm]],
                        "against_seeds": [s for s, _ in ends[base]], "tasks": c["tasks"],
                        "left_out": c["left_out"], "against_end": c["start"], "arm_end": c["end"],
                        "change": c["change"], "ci95": c["ci95"],
                        **{k: c[k] for k in ("gained", "lost", "both", "neither", "sign_test_p")
                           if k in c},
                        "by_seed": by_seed(a, arm, base)})
    how = (f"eval.py on each run's final checkpoint (RUN/eval_end.json): the curves' held-out "
           f"tasks, {a.cfg.eval_samples} sample(s) per task per seed at K={a.eval_turns}. By seed "
           "(the test): each seed's Avg@n of the arm minus the fixed arm's with the same seed, "
           "mean over seeds, 95% Student t interval. By task: seeds pooled (a task's score: its "
           "mean over all samples of all seeds), the mean per-task change, 95% normal interval "
           "(tools/paired.py); it holds the seeds fixed")
    return out, how


def draw(a, table: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig, (left, right, turns) = plt.subplots(1, 3, figsize=(17, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # equal curves must not hide each other: each arm its own dashes and marker size
    dashes, markers = ["-", "--", "-.", ":"], [9, 6, 4, 3]
    for i, t in enumerate(table):
        c, ls, ms = colors[i % len(colors)], dashes[i % len(dashes)], markers[i % len(markers)]
        if t["curve"]:
            st = [p["step"] for p in t["curve"]]
            left.plot(st, [p["mean"] for p in t["curve"]], color=c, marker="o", markersize=ms,
                      linestyle=ls, linewidth=2, label=t["label"])
            left.fill_between(st, [p["min"] for p in t["curve"]], [p["max"] for p in t["curve"]],
                              color=c, alpha=0.15, linewidth=0)
        for ax, key in ((right, "train_curve"), (turns, "turns_curve")):
            if t.get(key):
                st, ys = zip(*t[key])
                ax.plot(st, ys, color=c, alpha=0.25, linewidth=1)
                ax.plot(st, trailing_mean(list(ys), WINDOW), color=c, linestyle=ls, linewidth=2,
                        label=t["label"])
        every, stages = stage_steps(t["arm"], a.steps), len(horizons(t["arm"]))
        for j in range(1, stages):  # where a staged arm's horizon grows
            if j * every < a.steps:
                for ax in (left, right, turns):
                    ax.axvline(j * every + 0.5, color=c, linestyle=":", linewidth=1)
    if (c := study_chance(table)) is not None:
        left.axhline(c, color="black", linestyle="--", linewidth=1.2,
                     label=f"chance (a random policy): {100 * c:.1f}%")
    tasks = max((t["held_out_tasks"] for t in table), default=0)
    left.set(title=f"held-out success (K={a.eval_turns}, {tasks} tasks x {a.cfg.eval_samples})\n"
                   "mean over seeds; band: min-max over seeds", xlabel="step", ylabel="success")
    right.set(title=f"training success, mean over seeds\ntrailing mean of {WINDOW} steps "
                    "(faint: per step; dotted: a stage begins)", xlabel="step")
    turns.set(title="turns per training episode, mean over seeds\n"
                    f"trailing mean of {WINDOW} steps (faint: per step)", xlabel="step")
    for ax in (left, right, turns):
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a study whose runs were all skipped has none
            ax.legend(loc="best", fontsize=8)
    for ax in (left, right):
        ax.set_ylim(0, 1.03)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def study_chance(table: list[dict]) -> float | None:
    """The random policy's held-out success, the mean over the study's runs (each plays it with
    its own seed on the same tasks and K); None where the game defines none."""
    xs = [t["chance"] for t in table if t.get("chance") is not None]
    return mean(xs) if xs else None


def verdict(table: list[dict]) -> str:
    """Whether the study could tell the arms apart: only if some arm ended above chance."""
    c = study_chance(table)
    if c is None:
        return "Chance: the game defines no random policy, so none is drawn."
    ends = [t["held_out_last"]["mean"] for t in table if t["held_out_last"]]
    above = [t["label"] for t in table
             if t["held_out_last"] and t["held_out_last"]["mean"] > c]
    if not ends or not above:
        return (f"Chance (a random policy on the same tasks and K): {pct(c)}. "
                "**Uninformative: no arm ended above chance**, so the study cannot tell the arms "
                "apart.")
    return (f"Chance (a random policy on the same tasks and K): {pct(c)}. Ended above "
            f"it: {', '.join(above)}.")


def pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def interval(ci) -> str:
    return "(no interval)" if ci is None else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def markdown(a, table: list[dict], pairs: list[dict], how: str) -> str:
    k = table[0]["train_success_steps"]
    lines = [f"# Horizon study: {a.env}", "",
             f"Start: {a.model or 'the built-in tiny model'}; {a.steps} steps; seeds "
             f"{', '.join(map(str, a.seeds))}; held-out success at K={a.eval_turns} on "
             f"{table[0]['held_out_tasks']} tasks x {a.cfg.eval_samples} every {a.eval_every} "
             f"steps; {a.device}, {a.parallel} run(s) at once. Means over seeds; per seed in "
             "points. Training success: the mean of the first and of the last "
             f"{k} step{'s' * (k != 1)}. Minutes: the logged steps and evaluations, per run.", "",
             "| arm | seeds | held-out, first eval | held-out, last eval | per seed, first -> last "
             "| training success, first -> last | minutes |", "|---|---|---|---|---|---|---|"]
    for t in table:
        f, l = t["held_out_first"], t["held_out_last"]
        seeds = "; ".join(f"{s}: {100 * x:.1f} -> {100 * y:.1f}"
                          for s, x, y in zip(t["seeds"], f["per_seed"], l["per_seed"])) if f else ""
        lines.append(f"| {t['label']} | {len(t['seeds'])} | "
                     f"{pct(f and f['mean'])} (step {f and f['step']}) | "
                     f"{pct(l and l['mean'])} (step {l and l['step']}) | {seeds} | "
                     f"{pct(t['train_success_first']['mean'])} -> "
                     f"{pct(t['train_success_last']['mean'])} | {t['minutes']['mean']:.2f} |")
    lines += ["", verdict(table)]
    lines += ["", "| arm | generation tokens/s | training tokens/s | peak GPU MB |",
              "|---|---|---|---|"]
    lines += [f"| {t['label']} | {t['gen_tokens_per_s']:.0f} | {t['train_tokens_per_s']:.0f} | "
              f"{t['peak_gpu_mb']:.0f} |" for t in table]
    lines += ["", "## The end, paired task by task", "", how + "."]
    if pairs:
        lines += ["", "| arm | against | fixed arm's end | arm's end | by seed: change, 95% "
                      "interval (seeds) | by task: change, 95% interval (tasks) |",
                  "|---|---|---|---|---|---|"]
        for c in pairs:
            s = c["by_seed"]
            lines.append(f"| {label(c['arm'])} | {label(c['against'])} | "
                         f"{pct(c['against_end'])} | {pct(c['arm_end'])} | "
                         f"{100 * s['change']:+.1f} {interval(s['ci95'])} ({len(s['seeds'])}) | "
                         f"{100 * c['change']:+.1f} {interval(c['ci95'])} ({c['tasks']}) |")
    return "\n".join(lines) + "\n"


def source_commit() -> str | None:
    """The commit the study's code came from (git rev-parse HEAD, "+changes" when the work tree
    differs from it); None outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def report(a) -> dict:
    """Read every run of the study, write the figure and the table, print the table."""
    table = [arm_row(a, arm) for arm in a.arms]
    pairs, how = paired_ends(a)
    draw(a, table, os.path.join(a.out, "horizons.png"))
    text = markdown(a, table, pairs, how)
    with open(os.path.join(a.out, "horizons.md"), "w") as f:
        f.write(text)
    result = {"env": a.env, "model": a.model, "device": a.device, "steps": a.steps,
              "commit": source_commit(), "damaged_runs": list(getattr(a, "damaged", [])),
              "seeds": a.seeds, "eval_every": a.eval_every, "eval_turns": a.eval_turns,
              "eval_samples": a.cfg.eval_samples, "parallel": a.parallel,
              "band": "min-max over seeds", "train_smoothing": f"trailing mean of {WINDOW} steps",
              "arms": table, "paired": pairs, "paired_method": how}
    with open(os.path.join(a.out, "horizons.json"), "w") as f:
        json.dump(result, f, indent=2)
    print("\n" + text + f"\nwritten: {a.out}/horizons.md, horizons.json, horizons.png", flush=True)
    return result
