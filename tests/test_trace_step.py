"""The path a reader walks in one training step (bench/trace_step.py), held to a budget on the
README's Corridor command; and the tracer's counting rules on a file written for it."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import trace_step  # noqa: E402

# What step 2 of the README's Corridor command walks today: project lines of the functions that
# run, files, and the deepest chain of project functions. The aim: 1,000 lines in 9 files, 6 deep
# (the files and the depth met). A change may lower these, never raise them.
MAX_LINES, MAX_FILES, MAX_DEPTH = 1237, 9, 6
# The reading files' part (trace_step.READING: train.py, rollout.py, algos.py, scheduler.py,
# env_server/agents.py), its chain counting their functions alone. The aim: 500 lines, 5 deep
# (the depth met).
MAX_READING_LINES, MAX_READING_DEPTH = 584, 5


def test_one_steps_path_stays_within_its_budget():
    out = subprocess.run([sys.executable, "bench/trace_step.py", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    core = {"train.py", "rollout.py", "algos.py"}
    assert core <= set(r["files"]), r["files"]
    assert r["updated"], "the traced step did not train: its path leaves the update out"
    assert r["lines"] <= MAX_LINES and len(r["files"]) <= MAX_FILES and r["depth"] <= MAX_DEPTH, (
        f"one step walks {r['lines']} lines in {len(r['files'])} files, {r['depth']} deep "
        f"(budget {MAX_LINES}, {MAX_FILES}, {MAX_DEPTH}): {r['files']}")
    assert (r["reading_lines"] <= MAX_READING_LINES
            and r["reading_depth"] <= MAX_READING_DEPTH), (
        f"the reading files walk {r['reading_lines']} lines, {r['reading_depth']} deep (budget "
        f"{MAX_READING_LINES}, {MAX_READING_DEPTH}): {r['reading_chain']}")


def test_a_nested_function_counts_inside_its_parent(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent('''\
        import functools


        @functools.lru_cache
        def outer(x):
            """Two lines of
            docstring."""
            def inner(y):
                return [z for z in range(y)]
            return inner(x)


        class C:
            def method(self):
                return 1
        '''))
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    units = trace_step.Units()
    outer = units.of(ns["outer"].__wrapped__.__code__)
    inner_code = next(c for c in ns["outer"].__wrapped__.__code__.co_consts
                      if hasattr(c, "co_name") and c.co_name == "inner")
    assert outer == (str(path), 4, 10, "outer")  # the decorator and the docstring counted
    assert units.of(inner_code) == outer
    assert units.of(ns["C"].method.__code__) == (str(path), 14, 15, "C.method")


def test_the_executed_lines_leave_out_docstrings_and_branches_not_taken(tmp_path, monkeypatch):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent('''\
        def f(x):
            """A docstring
            of two lines."""
            if x:
                return 1
            return 2
        '''))
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    monkeypatch.setattr(trace_step, "ROOT", str(tmp_path))
    tracer = trace_step.Tracer(step=1)
    tracer.seen.add(tracer.units.of(ns["f"].__code__))
    sys.settrace(lambda frame, event, arg: tracer._line if event == "call" else None)
    try:
        ns["f"](0)
    finally:
        sys.settrace(None)
    r = trace_step.report(tracer)
    assert r["files"]["m.py"] == (6, 1, 2) and (r["lines"], r["executed"]) == (6, 2)
