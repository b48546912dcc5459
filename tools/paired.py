"""Two evaluations compared task by task: `eval.py --compare START,END` and
`python -m tools.plot --compare` read them here. A side may pool several results (A.json+B.json);
the change is the mean per-task difference with a 95% interval, overall and per category, and for
0/1 scores the paired counts and a sign test."""

from __future__ import annotations

import json
import os


def read_result(path: str) -> dict | str:
    """An eval.py result (a JSON object whose tasks each have an item_id and a list of scores), or
    what is wrong with the file, in a few words."""
    if not os.path.isfile(path):
        return f"no file {path}"
    try:
        with open(path) as f:
            r = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{path} is not a result of eval.py (not JSON)"
    tasks = r.get("tasks") if isinstance(r, dict) else None
    if not (isinstance(tasks, list) and all(isinstance(t, dict) and "item_id" in t
                                            and isinstance(t.get("scores"), list)
                                            for t in tasks)):
        return f"{path} is not a result of eval.py (it has no per-task scores)"
    return r


def compare_spec_error(spec: str) -> str | None:
    """What is wrong with a --compare value START[+START2...],END[+END2...], or None: two sides;
    every file there a result of eval.py (a list of tasks, each with its item_id and scores); all
    of one env and split, and a task in both sides."""
    paths = spec.split(",")
    if len(paths) != 2:
        return f"give two result files as START.json,END.json, not {spec!r}"
    names = [x for part in paths for x in part.split("+")]
    seen: dict = {}
    for path in names:  # by the file it names: ./a.json is a.json
        if os.path.realpath(path) in seen:
            return (f"{seen[os.path.realpath(path)]} and {path} are one file: a result "
                    "compared with itself, or pooled twice; name each file once")
        seen[os.path.realpath(path)] = path
    ids, games = [set(), set()], {}
    for side, path in ((s, x) for s, part in enumerate(paths) for x in part.split("+")):
        r = read_result(path)
        if isinstance(r, str):
            return r
        ids[side] |= {t["item_id"] for t in r["tasks"]}
        c = r.get("config") if isinstance(r.get("config"), dict) else {}
        games[path] = f"{c.get('env', '?')}/{c.get('split', '?')}"
    if len({g for g in games.values() if "?" not in g}) > 1:
        return "the results are of different envs or splits: " + ", ".join(
            f"{p} ({g})" for p, g in games.items())
    if not ids[0] & ids[1]:
        return "no task is in both sides: nothing to pair"
    return None


def pooled(paths: list[str]) -> dict:
    """Several results as one: each task's scores are all its samples in any of them (two
    evaluations of one model with different seeds, or one evaluation of each of several training
    seeds)."""
    tasks: dict = {}
    for path in paths:
        with open(path) as f:
            for t in json.load(f)["tasks"]:
                tasks.setdefault(t["item_id"], {**t, "scores": []})["scores"] += t["scores"]
    return {"tasks": list(tasks.values())}


def compare(start: dict, end: dict) -> dict:
    """Two results on the same tasks, paired task by task. Each task's score is its mean over its
    samples (the task's Avg@n); tasks missing from either result, or left without a scored sample,
    are left out and counted. The change is the mean of the per-task differences, with a 95% normal
    interval (1.96 standard errors of that mean), overall and per category (where the tasks have
    more than one); for 0/1 scores the paired counts and a two-sided exact sign test (McNemar's) on
    the tasks whose outcome changed."""
    import math

    def per_task(r):
        return {t["item_id"]: sum(t["scores"]) / len(t["scores"]) for t in r["tasks"]
                if t["scores"]}

    def paired(ids):
        d = [b[i] - a[i] for i in ids]
        n = len(d)
        mean = sum(d) / n if n else 0.0
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else float("nan")
        return {"tasks": n, "start": sum(a[i] for i in ids) / max(n, 1),
                "end": sum(b[i] for i in ids) / max(n, 1), "change": mean,
                "ci95": [mean - 1.96 * se, mean + 1.96 * se]}

    a, b = per_task(start), per_task(end)
    both = sorted(set(a) & set(b), key=str)
    listed = {t["item_id"] for t in start["tasks"]} | {t["item_id"] for t in end["tasks"]}
    out = {**paired(both), "left_out": len(listed) - len(both)}
    category = {t["item_id"]: t.get("category", "all") for t in start["tasks"]}
    names = sorted({category[i] for i in both}, key=str)
    if len(names) > 1:
        out["by_category"] = {c: paired([i for i in both if category[i] == c]) for c in names}
    # one 0/1 sample per task: paired counts
    if all(a[i] in (0, 1) and b[i] in (0, 1) for i in both):
        gained = sum(a[i] == 0 and b[i] == 1 for i in both)
        lost = sum(a[i] == 1 and b[i] == 0 for i in both)
        k, m = min(gained, lost), gained + lost
        p = min(1.0, 2 * sum(math.comb(m, j) for j in range(k + 1)) / 2 ** m) if m else 1.0
        out.update(both=sum(a[i] == 1 and b[i] == 1 for i in both), gained=gained, lost=lost,
                   neither=sum(a[i] == 0 and b[i] == 0 for i in both), sign_test_p=p)
    return out


def print_comparison(c: dict, start: str, end: str) -> None:
    lo, hi = c["ci95"]
    print(f"{c['tasks']} tasks in both results" + (f" ({c['left_out']} left out)" if c["left_out"]
                                                   else ""))
    print(f"  start {c['start']:.3f}  ({start})\n  end   {c['end']:.3f}  ({end})")
    print(f"  change {100 * c['change']:+.1f} points, 95% interval [{100 * lo:+.1f}, "
          f"{100 * hi:+.1f}]")
    if "gained" in c:
        print(f"  paired: {c['gained']} tasks gained, {c['lost']} lost, {c['both']} solved by "
              f"both, {c['neither']} by neither; sign test p = {c['sign_test_p']:.3f}")
    for name, row in c.get("by_category", {}).items():
        lo, hi = row["ci95"]
        print(f"  {name:<20}{row['tasks']:>4} tasks  {row['start']:.3f} -> {row['end']:.3f}  "
              f"{100 * row['change']:+6.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]")


def compare_results(spec: str) -> dict:
    """`eval.py --compare START,END`: each side read (pooled over its A.json+B.json files), the two
    compared task by task, and the comparison printed."""
    start, end = spec.split(",")
    c = compare(pooled(start.split("+")), pooled(end.split("+")))
    print_comparison(c, start, end)
    return c
