r"""The path a reader walks: every project function that runs in one training step, with its lines.

    python bench/trace_step.py                      # the README's Corridor command, 3 steps
    python bench/trace_step.py --step 2 -- --model smollm2-135m-sft --env textcraft --steps 2 ...

train.py runs in this process under `sys.settrace` (Python's own tracer), and every call into a
project file while train.main's `step` is the traced step is recorded: the rollout and the env
client's worker threads included, the env server (another process) not. A function counts with
every line of its definition, decorators and docstring included; a nested function,
comprehension or lambda counts inside the function it is written in. Beside them, the lines that
ran (executed: the distinct lines of those calls with a line event, so neither a docstring nor a
branch not taken). Printed: both per file, the total, and the deepest chain of project functions
on one thread's stack (train.main is 1); and the same for the reading files alone (READING: the
algorithm's own files), their chain counting only their own functions. tests/test_trace_step.py
holds both tiers' budgets on the README's command.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import threading
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The README's Corridor quick start (--steps cut to 3: step 2 is a step with a step before it)
CORRIDOR = ["--env", "corridor", "--schedule", "8", "--steps", "3", "--batch-size", "8",
            "--group-size", "8", "--max-new-tokens", "6", "--lr", "3e-3", "--eval-samples", "4",
            "--seed", "0"]
SKIP = ("tests", "bench", "docs", "runs")  # not the project's running code
# The files a reader of the algorithm walks; the rest is transport, speed and bookkeeping
READING = ("train.py", "rollout.py", "algos.py", "scheduler.py", "env_server/agents.py")


def is_project(path: str) -> bool:
    if not (path.endswith(".py") and path.startswith(ROOT + os.sep)):
        return False
    return os.path.relpath(path, ROOT).split(os.sep)[0] not in SKIP


class Units:
    """A code object's unit: the outermost function definition it is written in (file, first line,
    last line, name), decorators counted; a module-level lambda is its own unit."""

    def __init__(self):
        self.defs: dict[str, list] = {}

    def of(self, code) -> tuple:
        path = code.co_filename
        if path not in self.defs:
            tree = ast.parse(open(path, encoding="utf-8").read())
            found = []
            self._collect(tree, found, prefix="")
            self.defs[path] = found
        line = code.co_firstlineno
        for first, last, name in self.defs[path]:
            if first <= line <= last:
                return path, first, last, name
        return path, line, line, code.co_name  # module-level code (a class body, a lambda)

    def _collect(self, node, found: list, prefix: str) -> None:
        """The outermost functions under `node`: module functions and methods of classes."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((first, child.end_lineno, prefix + child.name))
            elif isinstance(child, ast.ClassDef):
                self._collect(child, found, prefix + child.name + ".")
            elif isinstance(child, ast.Lambda):
                found.append((child.lineno, child.end_lineno, prefix + "<lambda>"))
            else:
                self._collect(child, found, prefix)


class Tracer:
    """Records the units that run while train.main's `step` equals `step`."""

    def __init__(self, step: int):
        self.step, self.current = step, None
        self.units = Units()
        self.seen: set[tuple] = set()
        self.deepest: list[str] = []
        self.deepest_reading: list[str] = []
        self.main_code = None
        self.executed: set[tuple] = set()  # (path, line) of every line run in the step

    def _line(self, frame, event, arg):
        if event == "line":
            self.executed.add((frame.f_code.co_filename, frame.f_lineno))
        return self._line

    def _chain(self, frame) -> list[str]:
        chain, last = [], None
        while frame is not None:
            code = frame.f_code
            if is_project(code.co_filename):
                path, first, _, name = self.units.of(code)
                key = (path, first)
                if key != last:
                    chain.append(f"{os.path.relpath(path, ROOT)}:{name}")
                    last = key
            if code is self.main_code:
                self.current = frame.f_locals.get("step")
                break
            frame = frame.f_back
        return chain[::-1]

    def __call__(self, frame, event, arg):
        if event != "call" or not is_project(frame.f_code.co_filename):
            return None
        if self.main_code is None and frame.f_code.co_name == "main" \
                and os.path.basename(frame.f_code.co_filename) == "train.py":
            self.main_code = frame.f_code
        chain = self._chain(frame)
        if self.current == self.step:
            self.seen.add(self.units.of(frame.f_code))
            if len(chain) > len(self.deepest):
                self.deepest = chain
            reading = [c for c in chain if c.rsplit(":", 1)[0] in READING]
            if len(reading) > len(self.deepest_reading):
                self.deepest_reading = reading
            return self._line  # its lines, as they run
        return None


def report(tracer: Tracer) -> dict:
    """{"files": {file: (lines, functions)}, "lines", "functions", "depth", "chain", "units":
    ["file:first-last name", ...]}."""
    per_file: dict = defaultdict(lambda: [0, 0, 0])
    for path, first, last, _ in tracer.seen:
        rel = os.path.relpath(path, ROOT)
        per_file[rel][0] += last - first + 1
        per_file[rel][1] += 1
    for path, _ in tracer.executed:
        if is_project(path):
            per_file[os.path.relpath(path, ROOT)][2] += 1
    files = dict(sorted(per_file.items(), key=lambda kv: -kv[1][0]))
    return {"files": {k: tuple(v) for k, v in files.items()},
            "executed": sum(v[2] for v in files.values()),
            "reading_executed": sum(v[2] for k, v in files.items() if k in READING),
            "lines": sum(v[0] for v in files.values()),
            "functions": sum(v[1] for v in files.values()),
            "depth": len(tracer.deepest), "chain": tracer.deepest,
            "reading_lines": sum(v[0] for k, v in files.items() if k in READING),
            "reading_depth": len(tracer.deepest_reading),
            "reading_chain": tracer.deepest_reading,
            "units": [f"{os.path.relpath(path, ROOT)}:{first}-{last} {name}"
                      for path, first, last, name in sorted(tracer.seen)]}


def trace(argv: list[str], step: int = 2) -> dict:
    """Run train.py with `argv` (its own --out added when absent) and trace step `step`."""
    import train

    if "--out" not in argv:
        argv = argv + ["--out", tempfile.mkdtemp(prefix="trace-step-")]
    cfg = train.parse_args(argv)
    tracer = Tracer(step)
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        train.main(cfg)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        traced = next(m for m in map(json.loads, f) if m["step"] == step)
    # whether the traced step trained (an informative group, an update applied): else its path
    # leaves the update out
    updated = bool(traced.get("groups_informative")) and not traced.get("skipped_update")
    return {**report(tracer), "updated": updated}


def show(r: dict) -> None:
    w = max(len(f) for f in r["files"])
    print(f"{'file':{w}}  lines  functions  executed")
    for f, (lines, n, ran) in r["files"].items():
        print(f"{f:{w}}  {lines:5d}  {n:9d}  {ran:8d}")
    print(f"{'total':{w}}  {r['lines']:5d}  {r['functions']:9d}  {r['executed']:8d}   in "
          f"{len(r['files'])} files")
    print(f"deepest chain ({r['depth']}): " + " -> ".join(r["chain"]))
    print(f"the reading files ({', '.join(READING)}): {r['reading_lines']} lines "
          f"({r['reading_executed']} executed); deepest chain within them ({r['reading_depth']}): "
          + " -> ".join(r["reading_chain"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", type=int, default=2, help="the step to trace (default 2)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    p.add_argument("--units", action="store_true", help="also list every function that ran")
    p.add_argument("train_args", nargs="*", help="train.py's flags after --; default: the "
                   "README's Corridor command with --steps 3")
    a = p.parse_args()
    r = trace(a.train_args or CORRIDOR, a.step)
    if a.json:
        print(json.dumps(r))
    else:
        show(r)
    if a.units and not a.json:
        print("\n".join(r["units"]))


if __name__ == "__main__":
    main()
