"""What a TextCraft policy plans before it acts: per depth, the recipes its first thought lists,
and, where the thought marks each ingredient as the checked warm start writes it (`beacon using 5
glass, 1 nether star (glass: get, nether star: craft)`), how many of the marks are right, judged
against the crafting commands the task listed (an ingredient is `craft` when one of them makes it,
for a tag one of its members).

    python bench/first_thoughts.py runs/eval-start.json runs/eval-end-0.json+runs/eval-end-1.json

Each argument is an eval.py result of TextCraft's built-in world, with its episodes beside it
(NAME.rollouts.jsonl); `+` joins evaluations of one model. One line per argument and depth:
episodes, the mean recipes listed, the share listing one and two or more, and the marks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from env_server.textcraft import TextCraftEnv, ingredient_kind, listed_outputs  # noqa: E402
from env_server.textcraft_world import to_id  # noqa: E402
from tools.paired import read_result  # noqa: E402

_MARKS = re.compile(r"\(([^()]*)\)")


def first_thought(messages: list[dict]) -> tuple[str, str] | None:
    """(the task's first observation, the thought of the first reply to it), or None before any
    reply."""
    for i, m in enumerate(messages):
        if m["role"] == "user" and m["content"].startswith("Crafting commands:"):
            reply = next((r["content"] for r in messages[i + 1:] if r["role"] == "assistant"), None)
            return None if reply is None else (m["content"], reply.split("Action:")[0])
    return None


def read_thought(world, observation: str, thought: str) -> tuple[int, int, int]:
    """(recipes listed, marks written, marks right) of one first thought."""
    made = listed_outputs([c for c in observation.splitlines()
                           if c.startswith("craft ") and " using " in c])
    parts = thought.split(";")
    written = right = 0
    for part in parts:
        m = _MARKS.search(part)
        for mark in m[1].split(",") if m else ():
            if ":" not in mark:
                continue
            item, kind = (x.strip().rstrip(".") for x in mark.split(":", 1))
            written += 1
            right += kind == ingredient_kind(world, made, to_id(item))
    return sum(" using " in p for p in parts), written, right


def summarize(world, rows: list[dict], category: dict) -> dict:
    """category -> {episodes, recipes (mean), one, two_plus (shares), marked (share of thoughts with
    marks), marks, marks_right (share)}, over the rows' first thoughts."""
    out: dict = {}
    for row in rows:
        got = first_thought(row["messages"])
        if got is None or row["item_id"] not in category:
            continue
        listed, written, right = read_thought(world, *got)
        s = out.setdefault(category[row["item_id"]], {"episodes": 0, "recipes": 0, "one": 0,
                                                      "two_plus": 0, "marked": 0, "marks": 0,
                                                      "right": 0})
        s["episodes"] += 1
        s["recipes"] += listed
        s["one"] += listed == 1
        s["two_plus"] += listed >= 2
        s["marked"] += written > 0
        s["marks"] += written
        s["right"] += right
    for s in out.values():
        n = s["episodes"]
        s.update(recipes=s["recipes"] / n, one=s["one"] / n, two_plus=s["two_plus"] / n,
                 marked=s["marked"] / n,
                 marks_right=s.pop("right") / s["marks"] if s["marks"] else None)
    return dict(sorted(out.items()))


def load(arg: str) -> tuple[list[dict], dict]:
    rows, category = [], {}
    for path in arg.split("+"):
        episodes = path.removesuffix(".json") + ".rollouts.jsonl"
        for p in (path, episodes):
            if not os.path.exists(p):
                sys.exit(f"first_thoughts.py: {p} not found "
                         "(give eval.py results, their episodes beside them)")
        result = read_result(path)
        if isinstance(result, str):
            sys.exit(f"first_thoughts.py: {result}")
        if (result.get("config") or {}).get("env", "textcraft") != "textcraft":
            sys.exit(f"first_thoughts.py: {path} is not a TextCraft evaluation")
        category.update({t["item_id"]: t.get("category", "all") for t in result["tasks"]})
        rows += [json.loads(line) for line in open(episodes, encoding="utf-8")]
    return rows, category


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="first_thoughts.py")
    p.add_argument("results", nargs="+", help="eval.py results; A+B joins evaluations of one model")
    args = p.parse_args(argv)
    # every file checked before anything is printed
    loaded = [(arg, *load(arg)) for arg in args.results]
    world = TextCraftEnv.load_world(None)
    names = ["+".join(os.path.basename(p).removesuffix(".json") for p in arg.split("+"))
             for arg, *_ in loaded]
    w = max(len(n) for n in names + ["result"])
    print(f"{'result':{w}s} {'depth':8s} {'episodes':>8s} {'recipes':>7s} {'one':>5s} {'2+':>5s} "
          f"{'marked':>6s} {'marks':>5s} {'right':>5s}")
    for name, (_, rows, category) in zip(names, loaded):
        for cat, s in summarize(world, rows, category).items():
            right = f"{100 * s['marks_right']:4.0f}%" if s["marks_right"] is not None else "    -"
            print(f"{name:{w}s} {cat:8s} {s['episodes']:8d} {s['recipes']:7.2f} "
                  f"{100 * s['one']:4.0f}% {100 * s['two_plus']:4.0f}% {100 * s['marked']:5.0f}% "
                  f"{s['marks']:5d} {right}")


if __name__ == "__main__":
    main()
