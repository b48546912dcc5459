"""Training curves of one or more runs: success rate, held-out success and mean reward against step,
horizon stages shaded.

    python -m tools.plot runs/textcraft__grpo__0__A runs/textcraft__grpo__0__B --out curves.png
        --labels K=10,K=10-30

Without --out, one run's curves go to RUN/curves.png, several runs' to curves_A_vs_B.png in the
current folder (never into one of the runs).

Reads RUN_DIR/metrics.jsonl (one line per step, as train.py writes it), RUN_DIR/eval.jsonl (the
held-out evaluations, when present: a middle panel) and RUN_DIR/config.json (the label
env/algo/schedule when --labels is absent). The turn horizon K of every step is read from the
`max_turns` column, so the shaded stages are the horizons actually used (a plateau schedule
included): light background bands labelled K=.. for the first run with more than one stage, and
dotted vertical lines in its colour where another run's horizon changes at different steps. Raw
values are drawn faint, a trailing moving average over --smooth steps solid. Matplotlib with the Agg
backend (no display needed).

    python -m tools.plot --compare s0.json+s1.json,a0.json+a1.json --compare s0.json+s1.json,b0.json
        --out changes.png

draws instead the paired changes of eval.py --compare (start -> end, 95% interval), overall and per
category, one colour per --compare.

    python -m tools.plot --curve 0=s0.json+s1.json,10=a0.json+a1.json,20=b0.json+b1.json
        --curve 0=...,10=... --out held_out.png

draws held-out curves from eval.py results: one line per --curve, each point a step's success (each
side may pool results with +), with the 95% paired interval of its change from the curve's first
point.
"""

from __future__ import annotations

import json
import os
import sys

from trainer.cli import Parser, check_writable


def read_jsonl(path: str) -> list:
    """The rows of a JSONL file; a last line that does not parse yet (a live run is writing it) is
    left out, any other names its file and line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for k, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if k < len(lines) - 1:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
    return rows


def read_run(run_dir: str) -> dict:
    """{"steps", "success_rate", "reward_mean", "max_turns", "guess_share", "eval_steps",
    "eval_success", "config"} of one run folder."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl in this folder (is it a train.py run "
                         "folder?)")
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl is empty (the run has not finished a step yet)")
    rows.sort(key=lambda r: r["step"])
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    evals = []
    if os.path.isfile(os.path.join(run_dir, "eval.jsonl")):
        evals = sorted(read_jsonl(os.path.join(run_dir, "eval.jsonl")), key=lambda r: r["step"])
    return {"steps": [r["step"] for r in rows], "success_rate": [r["success_rate"] for r in rows],
            "reward_mean": [r["reward_mean"] for r in rows],
            "max_turns": [r["max_turns"] for r in rows],
            # runs from before the metric: 0
            "guess_share": [r.get("guess_share", 0.0) for r in rows],
            # how far each update moved the policy, and the share of groups with a signal (nan: not
            # logged)
            "update_kl": [nan_if_none(r.get("update_kl")) for r in rows],
            "groups_informative": [nan_if_none(r.get("groups_informative")) for r in rows],
            "eval_steps": [r["step"] for r in evals],
            "eval_success": [r["success_rate"] for r in evals], "config": config,
            # a random policy's held-out success on the same tasks and K (None: not measured)
            "chance": next((r["chance"] for r in evals if r.get("chance") is not None), None)}


def nan_if_none(x) -> float:
    return float("nan") if x is None else float(x)


def stages(steps: list[int], max_turns: list[int]) -> list[tuple[int, int, int]]:
    """(first step, last step, K) of each run of equal horizons, like scheduler.stage_bounds."""
    out: list[tuple[int, int, int]] = []
    for s, k in zip(steps, max_turns):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], s, k)
        else:
            out.append((s, s, k))
    return out


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average; the first points average what exists so far."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def label_of(run_dir: str, config: dict) -> str:
    if not config:
        return os.path.basename(os.path.normpath(run_dir))
    return f"{config.get('env', '?')} {config.get('algo', '?')} K={config.get('schedule', '?')}"


def save_figure(fig, out: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot(run_dirs: list[str], out: str, window: int = 5, labels: list[str] | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d) for d in run_dirs]
    labels = labels or [label_of(d, r["config"]) for d, r in zip(run_dirs, runs)]
    assert len(labels) == len(runs), f"{len(labels)} labels for {len(runs)} runs"
    panels = [("success_rate", "training success"), ("reward_mean", "training reward")]
    if any(r["eval_steps"] for r in runs):
        panels.insert(1, ("eval_success", "held-out success"))
    if any(any(r["guess_share"]) for r in runs):  # the built-in warm start's habit, unlearned
        panels.append(("guess_share", "share opening with the habit\n(a guess or a stall)"))
    for key, title in (("groups_informative", "informative groups\n(scores differ)"),
                       ("update_kl", "update KL per token\n(before || after, log)")):
        if any(v == v for r in runs for v in r[key]):  # any run that logged it (nan != nan)
            panels.append((key, title))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True)
    run_stages = [stages(r["steps"], r["max_turns"]) for r in runs]
    shaded = next((i for i, st in enumerate(run_stages) if len(st) > 1), 0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, panels):
        # Stage bands of one run: half a step either side, so that adjacent bands meet.
        for j, (a, b, k) in enumerate(run_stages[shaded]):
            ax.axvspan(a - 0.5, b + 0.5, color=("#e8eef7" if j % 2 == 0 else "#f5efe6"), zorder=0)
            ax.text((a + b) / 2, 1.0, f"K={k}", transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=8, color="0.35")
        drawn = set()  # the --max-update-kl bounds drawn on this panel
        for i, (r, name) in enumerate(zip(runs, labels)):
            c = colors[i % len(colors)]
            if i != shaded and run_stages[i] != run_stages[shaded]:
                for a, _b, _k in run_stages[i][1:]:
                    ax.axvline(a - 0.5, color=c, linestyle=":", linewidth=1)
            if key == "eval_success":  # a few points: drawn as they are, chance dashed
                ax.plot(r["eval_steps"], r[key], color=c, linewidth=2, marker="o", label=name)
                if r["chance"] is not None:
                    ax.axhline(r["chance"], color=c, linestyle="--", linewidth=1)
                    ax.text(r["eval_steps"][-1], r["chance"], f"chance {r['chance']:.3f} ",
                            color=c, fontsize=7, va="bottom", ha="right")
                ax.set_ylim(bottom=0)
                continue
            # spans decades, and a single step that moved far is the point: raw, log scale
            if key == "update_kl":
                ax.plot(r["steps"], r[key], color=c, linewidth=2, marker=".", label=name)
                ax.set_yscale("log")
                bound = r["config"].get("max_update_kl")
                if bound and bound not in drawn:  # one line per bound, however many runs share it
                    drawn.add(bound)
                    ax.axhline(bound, color="0.4", linestyle="--", linewidth=1)
                    ax.text(r["steps"][0], bound, f" --max-update-kl {bound:g}: a step above it "
                                                  "halves the lr",
                            color="0.3", fontsize=7, va="bottom")
                continue
            ax.plot(r["steps"], r[key], color=c, alpha=0.25, linewidth=1)
            ax.plot(r["steps"], smooth(r[key], window), color=c, linewidth=2, label=name)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("step")
    return save_figure(fig, out)


def plot_changes(specs: list[str], out: str, labels: list[str] | None = None) -> str:
    """The paired changes of eval.py --compare, one per START[+..],END[+..] in `specs`, drawn side
    by side as points with their 95% intervals: overall, then per category (TextCraft's depths)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.paired import compare, pooled

    changes = [compare(*(pooled(side.split("+")) for side in spec.split(","))) for spec in specs]
    labels = labels or specs
    names = ["overall"] + sorted({c for ch in changes for c in ch.get("by_category", {})})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(names) + 2), 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(changes)
    for i, (ch, label) in enumerate(zip(changes, labels)):
        rows = [(j, ch if name == "overall" else ch.get("by_category", {}).get(name))
                for j, name in enumerate(names)]
        rows = [(j - 0.4 + width * (i + 0.5), r) for j, r in rows if r is not None]
        ys = [100 * r["change"] for _, r in rows]
        below = [y - 100 * r["ci95"][0] for y, (_, r) in zip(ys, rows)]
        above = [100 * r["ci95"][1] - y for y, (_, r) in zip(ys, rows)]
        ax.errorbar([x for x, _ in rows], ys, yerr=[below, above], fmt="o", capsize=3,
                    color=colors[i % len(colors)], label=label)
    ax.axhline(0, color="0.3", linewidth=1)
    def counts(name):  # the tasks of each point drawn there, once where they all agree
        rows = [ch if name == "overall" else ch.get("by_category", {}).get(name) for ch in changes]
        n = sorted({r["tasks"] for r in rows if r is not None})
        return "/".join(map(str, n)) + " tasks"
    ax.set_xticks(range(len(names)), [f"{n}\n({counts(n)})" for n in names])
    ax.set_ylabel("change, points\n(95% paired interval)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, out)


def curve_points(spec: str) -> list[tuple[int, float, float, float]]:
    """(step, success, low, high) for each STEP=RESULT[+RESULT..] of a --curve: success is the mean
    over the tasks of each task's mean score; low-high is the first point's success plus the 95%
    paired interval of the change from it (eval.py --compare), so a point whose bar clears the first
    point's level moved beyond the noise. The first point's bar has no width."""
    from tools.paired import compare, pooled

    points = [(int(step), pooled(files.split("+")))
              for step, files in (p.split("=", 1) for p in spec.split(","))]
    out = []
    for step, result in points:
        c = compare(points[0][1], result)
        out.append((step, c["end"], c["start"] + c["ci95"][0], c["start"] + c["ci95"][1]))
    return out


def curve_spec_error(spec: str) -> str | None:
    """What is wrong with a --curve value STEP=RESULT[+..],STEP=RESULT[+..],..., or None."""
    from tools.paired import compare_spec_error

    parts = [p.split("=", 1) for p in spec.split(",")]
    if len(parts) < 2 or any(len(p) != 2 or not p[0].isdigit() for p in parts):
        return f"give two or more points as STEP=RESULT.json[+RESULT2.json],STEP=..., not {spec!r}"
    steps = [int(p[0]) for p in parts]
    if steps != sorted(set(steps)):
        return f"the steps must increase: {spec!r}"
    return next(filter(None,
                       (compare_spec_error(f"{parts[0][1]},{files}") for _, files in parts[1:])),
                None)


def plot_curves(specs: list[str], out: str, labels: list[str] | None = None) -> str:
    """Held-out success against step, one line per --curve, with each point's paired interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    curves = [list(zip(*curve_points(spec))) for spec in specs]
    span = max(max(c[0]) for c in curves) - min(min(c[0]) for c in curves)
    for i, ((steps, ys, lo, hi), label) in enumerate(zip(curves, labels or specs)):
        # side by side: equal steps' bars do not hide each other
        shift = 0.012 * span * (i - (len(specs) - 1) / 2)
        color = colors[i % len(colors)]
        # the level a bar must clear
        ax.axhline(100 * ys[0], color=color, linestyle="--", linewidth=0.8, alpha=0.6)
        ax.errorbar([s + shift for s in steps], [100 * y for y in ys], capsize=3, marker="o",
                    linewidth=2,
                    yerr=[[100 * (y - a) for y, a in zip(ys, lo)],
                          [100 * (b - y) for y, b in zip(ys, hi)]], color=color, label=label)
    ax.set_xticks(sorted({s for c in curves for s in c[0]}))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out success, %\n(bars: 95% paired interval of the\nchange from the first "
                  "point)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, out)


def main(argv=None) -> None:
    p = Parser(prog="python -m tools.plot", description=__doc__)  # one-line errors
    p.add_argument("runs", nargs="*", help="run folders, each with metrics.jsonl")
    p.add_argument("--compare", action="append", default=None, metavar="START,END",
                   help="instead of runs: eval.py results compared as eval.py --compare does (each "
                        "side may pool results with +); repeat it to draw several changes side by "
                        "side, overall and per category")
    p.add_argument("--curve", action="append", default=None, metavar="STEP=RESULT,STEP=RESULT",
                   help="instead of runs: a held-out curve from eval.py results (each point may "
                        "pool results with +), bars the paired interval of the change from its "
                        "first point; repeat it for more lines")
    p.add_argument("--out", default=None, help="image file to write, .png added to a name "
                                               "without an extension (default: one run's "
                                               "RUN/curves.png; several runs' "
                                               "curves_A_vs_B.png in the current folder)")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window in steps (1: none)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    a = p.parse_args(argv)
    if sum(map(bool, (a.runs, a.compare, a.curve))) != 1:
        p.error("give run folders, --compare START,END or --curve STEP=RESULT,... (one or more), "
                "one of the three")
    drawn = a.compare or a.curve or a.runs
    labels = a.labels.split(",") if a.labels else None
    if labels is not None and len(labels) != len(drawn):
        kind = "comparisons" if a.compare else "curves" if a.curve else "runs"
        p.error(f"--labels has {len(labels)} names for {len(drawn)} {kind}")
    if a.smooth < 1:
        p.error("--smooth must be at least 1")
    if a.compare:
        from tools.paired import compare_spec_error
        for wrong in filter(None, map(compare_spec_error, a.compare)):
            p.error(f"--compare: {wrong}")
    for wrong in filter(None, map(curve_spec_error, a.curve or [])):
        p.error(f"--curve: {wrong}")
    if (a.compare or a.curve) and not a.out:
        p.error(f"{'--compare' if a.compare else '--curve'} needs --out: the image file to write")
    out = image_path(p, a.out) if a.out else image_path(p, default_out(a.runs), "the image")
    try:
        if a.runs:
            out = plot(a.runs, out, a.smooth, labels)
        else:
            out = (plot_changes if a.compare else plot_curves)(drawn, out, labels)
    except ValueError as e:
        sys.exit(f"python -m tools.plot: {e}")
    where = " (several runs: in the current folder; --out names another file)" \
        if len(a.runs) > 1 and not a.out else ""
    print(f"wrote {out}{where}")


def image_path(p, out: str, flag: str = "--out") -> str:
    """The image file --out names (`flag`: how errors name it), as it will be written: .png added
    where it has no extension (as matplotlib does); a folder, an extension matplotlib does not
    write, a file in the way or a folder this process cannot write in is one line, before anything
    is drawn."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_writable(p, flag, out, "the image file to write (e.g. "
                   f"{os.path.join(out, 'curves.png')})", folder=False)
    kind = os.path.splitext(out)[1][1:].lower()
    if not kind:
        out += ".png"
    elif kind not in (kinds := FigureCanvasBase.get_supported_filetypes()):
        p.error(f"{flag} {out}: matplotlib does not write .{kind} files; give one of "
                + ", ".join(f".{k}" for k in sorted(kinds)))
    return out


def default_out(run_dirs: list[str]) -> str:
    """One run's curves go beside its metrics (RUN/curves.png). A comparison of several belongs to
    none of them (it once overwrote the first run's own curves.png): it goes to the current folder,
    named after the runs."""
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "curves.png")
    names = [os.path.basename(os.path.abspath(d)) for d in run_dirs]
    name = "_vs_".join(names)
    if len(name) > 150:  # a file name has 255 bytes at most
        name = f"{names[0]}_and_{len(names) - 1}_more"
    return f"curves_{name}.png"


if __name__ == "__main__":
    main()
