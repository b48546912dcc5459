"""The layout holds: scripts on top of a flat library layer, imports running downward only (no cycle,
no library module importing a script, nothing but tests and bench importing train.py), and the core
files short enough to read in one sitting."""

import ast
import os

from conftest import ROOT

SCRIPTS = {"train", "eval", "sft", "plot", "viewer"}


def project_modules() -> dict[str, str]:
    """module name -> file, for every .py of the project outside tests/ and bench/."""
    mods = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d not in ("tests", "bench", "docs", "runs")]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return mods


def imports_of(path: str, mods: dict) -> set[str]:
    """The project modules a file imports, at any depth (function-level imports count too)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: inside a package
            package = os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
            base = f"{package}.{node.module}" if node.module else package
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(p, mods) - {m} for m, p in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]):
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else [m, n]
            if n not in state and (c := visit(n, path + [m])):
                return c
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m, [])):
            return c
    return None


def test_no_import_cycle():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()))}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_library_modules_import_no_script():
    g = graph()
    offenders = {m: sorted(g[m] & SCRIPTS) for m in g if m not in SCRIPTS and g[m] & SCRIPTS}
    assert not offenders, f"library modules importing scripts: {offenders}"
    assert not [m for m in g if "train" in g[m]], "only tests and bench may import train.py"


def test_the_scripts_and_the_named_top_level_files_exist():
    for name in ("train.py", "rollout.py", "algos.py", "scheduler.py", "env_client.py", "eval.py",
                 "requirements.txt", "env_server/__init__.py", "tests"):
        assert os.path.exists(os.path.join(ROOT, name)), name


def test_core_files_read_in_one_sitting():
    """train.py stays near 560 lines and no module passes 600; no function in the core files passes about 80
    lines."""
    assert len(open(os.path.join(ROOT, "train.py")).readlines()) <= 600
    lines = {m: len(open(f, encoding="utf-8").readlines()) for m, f in project_modules().items()}
    assert not {m: n for m, n in lines.items() if n > 600}, "modules past 600 lines: split them at a seam"
    for name in ("train.py", "rollout.py", "algos.py", "scheduler.py"):
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 85]
        assert not long, f"{name}: functions past 80 lines: {long}"
