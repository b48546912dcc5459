"""plot.py: two runs (one fixed horizon, one with stages K=2 then K=4) make a PNG; stages are read
off the max_turns column; held-out evaluations and a guessing habit add a panel each; a folder
without metrics names itself in the error."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

from tools import plot


def write_run(folder, max_turns, schedule):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, k in enumerate(max_turns, start=1):
            f.write(json.dumps({"step": step, "max_turns": k, "success_rate": step / len(max_turns),
                                "reward_mean": 0.5 * step / len(max_turns)}) + "\n")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"env": "corridor", "algo": "grpo", "schedule": schedule}, f)


def test_two_runs_make_a_png(tmp_path):
    write_run(tmp_path / "fixed", [4] * 8, "4")
    write_run(tmp_path / "staged", [2] * 4 + [4] * 4, "2,4")
    out = tmp_path / "curves.png"
    res = subprocess.run([sys.executable, "-m", "tools.plot", str(tmp_path / "fixed"),
                          str(tmp_path / "staged"), "--out", str(out), "--smooth", "3",
                          "--labels", "fixed,staged"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_held_out_evaluations_get_their_own_panel(tmp_path):
    """A run with eval.jsonl adds the held-out panel (three axes); read_run returns its points in
    order."""
    write_run(tmp_path / "r", [2] * 3 + [4] * 3, "2,4")
    with open(tmp_path / "r" / "eval.jsonl", "w") as f:
        for step, rate in ((6, 0.5), (0, 0.25), (3, 0.3)):
            f.write(json.dumps({"step": step, "success_rate": rate, "chance": 0.2}) + "\n")
    run = plot.read_run(str(tmp_path / "r"))
    assert run["eval_steps"] == [0, 3, 6] and run["eval_success"] == [0.25, 0.3, 0.5]
    assert run["chance"] == 0.2  # drawn dashed on the held-out panel
    import matplotlib.pyplot as plt
    seen = []
    real = plt.subplots
    plt.subplots = lambda n, *a, **k: seen.append(n) or real(n, *a, **k)
    try:
        plot.plot([str(tmp_path / "r")], str(tmp_path / "e.png"))
        write_run(tmp_path / "no_eval", [2] * 3, "2")
        plot.plot([str(tmp_path / "no_eval")], str(tmp_path / "n.png"))
    finally:
        plt.subplots = real
    assert seen == [3, 2] and (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def test_a_guessing_habit_gets_its_own_panel(tmp_path):
    """Runs whose metrics carry guess_share > 0 (the built-in warm start's habit) add its panel;
    rows without the column read as 0."""
    write_run(tmp_path / "old", [2] * 3, "2")
    write_run(tmp_path / "g", [2] * 3, "2")
    with open(tmp_path / "g" / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    with open(tmp_path / "g" / "metrics.jsonl", "w") as f:
        for row, share in zip(rows, (0.75, 0.4, 0.05)):
            f.write(json.dumps({**row, "guess_share": share}) + "\n")
    assert plot.read_run(str(tmp_path / "old"))["guess_share"] == [0.0] * 3
    assert plot.read_run(str(tmp_path / "g"))["guess_share"] == [0.75, 0.4, 0.05]
    import matplotlib.pyplot as plt
    seen = []
    real = plt.subplots
    plt.subplots = lambda n, *a, **k: seen.append(n) or real(n, *a, **k)
    try:
        plot.plot([str(tmp_path / "old"), str(tmp_path / "g")], str(tmp_path / "g.png"))
        plot.plot([str(tmp_path / "old")], str(tmp_path / "o.png"))
    finally:
        plt.subplots = real
    assert seen == [3, 2] and (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_stages_and_smoothing():
    assert plot.stages([1, 2, 3, 4, 5], [2, 2, 4, 4, 4]) == [(1, 2, 2), (3, 5, 4)]
    assert plot.smooth([0, 3, 6, 9], 2) == [0, 1.5, 4.5, 7.5]


def test_missing_or_empty_metrics_names_the_folder(tmp_path):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    res = subprocess.run([sys.executable, "-m", "tools.plot", str(empty), "--out",
                          str(tmp_path / "x.png")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and str(empty) in res.stderr and "metrics.jsonl" in res.stderr
    (empty / "metrics.jsonl").write_text("")
    res = subprocess.run([sys.executable, "-m", "tools.plot", str(empty), "--out",
                          str(tmp_path / "x.png")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and str(empty) in res.stderr and "empty" in res.stderr


def test_update_kl_and_informative_groups_get_their_panels(tmp_path):
    """Runs whose metrics carry update_kl and groups_informative (a step without an update logs no
    update_kl: nan) add a panel each; older runs read as nan and add none."""
    write_run(tmp_path / "new", [2] * 3, "2")
    with open(tmp_path / "new" / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    with open(tmp_path / "new" / "metrics.jsonl", "w") as f:
        for row, kl in zip(rows, (1e-5, None, 3e-3)):
            f.write(json.dumps({**row, "groups_informative": 0.5,
                                **({"update_kl": kl} if kl else {})}) + "\n")
    run = plot.read_run(str(tmp_path / "new"))
    assert (run["update_kl"][0] == 1e-5 and run["update_kl"][1] != run["update_kl"][1]
            and run["update_kl"][2] == 3e-3)
    write_run(tmp_path / "old", [2] * 3, "2")
    import matplotlib.pyplot as plt
    seen = []
    real = plt.subplots
    plt.subplots = lambda n, *a, **k: seen.append(n) or real(n, *a, **k)
    try:
        plot.plot([str(tmp_path / "new")], str(tmp_path / "n.png"))
        plot.plot([str(tmp_path / "old")], str(tmp_path / "o.png"))
    finally:
        plt.subplots = real
    assert seen == [4, 2] and (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"


def test_the_update_kl_panel_draws_the_runs_guard_once(tmp_path):
    """Two runs with --max-update-kl 0.01 (and one without): one dashed line at the bound."""
    for name, bound in (("a", 0.01), ("b", 0.01), ("c", None)):
        write_run(tmp_path / name, [2] * 3, "2")
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows = [json.loads(x) for x in f]
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({**row, "update_kl": 1e-3 * (i + 1)}) + "\n"
                         for i, row in enumerate(rows))
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump({"env": "textcraft", "algo": "grpo", "schedule": "2",
                       "max_update_kl": bound}, f)
    import matplotlib.pyplot as plt
    made = []
    real = plt.subplots
    plt.subplots = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    try:
        plot.plot([str(tmp_path / n) for n in "abc"], str(tmp_path / "k.png"))
    finally:
        plt.subplots = real
    kl_axis = made[0][1][-1]
    flat = [ln for ln in kl_axis.get_lines() if len(set(ln.get_ydata())) == 1]
    assert len(flat) == 1 and flat[0].get_ydata()[0] == 0.01 and flat[0].get_linestyle() == "--"


def test_the_default_image_of_several_runs_goes_to_the_current_folder(tmp_path):
    """Once it went to the first run's folder, over that run's own curves.png."""
    write_run(tmp_path / "a", [2] * 4, "2")
    write_run(tmp_path / "b", [2] * 4, "2")
    (tmp_path / "a" / "curves.png").write_bytes(b"a's own")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    res = subprocess.run([sys.executable, "-m", "tools.plot", str(tmp_path / "a"),
                          str(tmp_path / "b")],
                         cwd=elsewhere, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (elsewhere / "curves_a_vs_b.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "a" / "curves.png").read_bytes() == b"a's own"
    assert "wrote curves_a_vs_b.png (several runs: in the current folder" in res.stdout
    # one run: beside its metrics; many: named after the first
    assert plot.default_out([str(tmp_path / "a")]) == str(tmp_path / "a" / "curves.png")
    assert plot.default_out([f"runs/r{i:02d}_{'x' * 20}" for i in range(9)]) == \
        f"curves_r00_{'x' * 20}_and_8_more.png"


def test_changes_of_eval_results_make_a_png_and_bad_input_names_itself(tmp_path):
    def result(name, scores):  # task i: category depth_1 for i < 4, else depth_2
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tasks": [{"item_id": i, "category": f"depth_{1 + (i >= 4)}",
                                               "scores": s}
                                              for i, s in enumerate(scores)]}))
        return str(path)

    s0, s1 = (result("s0", [[0.0]] * 4 + [[1.0]] * 4),
              result("s1", [[1.0]] + [[0.0]] * 3 + [[1.0]] * 4))
    e0 = result("e0", [[1.0]] * 4 + [[0.0]] * 4)
    out = tmp_path / "changes.png"
    seen = []
    import matplotlib.axes
    real = matplotlib.axes.Axes.errorbar
    matplotlib.axes.Axes.errorbar = (lambda self, x, y, **k: seen.append((list(x), list(y)))
                                     or real(self, x, y, **k))
    try:
        plot.main(["--compare", f"{s0}+{s1},{e0}", "--compare", f"{s0},{e0}", "--out", str(out),
                   "--labels", "a,b"])
    finally:
        matplotlib.axes.Axes.errorbar = real
    assert out.stat().st_size > 0
    # overall, depth_1, depth_2 for each comparison: pooled start 1/8, 0, 0, 0 on depth 1 -> +87.5;
    # depth 2 -> -100
    assert ([round(y, 1) for y in seen[0][1]] == [-6.2, 87.5, -100.0]
            and seen[1][1] == [0.0, 100.0, -100.0])
    assert seen[0][0][0] < seen[1][0][0] < 1  # side by side within each category
    # a comparison of depth 2 alone beside one of both depths: each tick counts both
    s2, e2 = result("s2", [[0.0]] * 8), result("e2", [[1.0]] * 8)
    for name in ("s2", "e2"):  # tasks 4-7 only
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tasks": json.loads(path.read_text())["tasks"][4:]}))
    ticks = []
    real_ticks = matplotlib.axes.Axes.set_xticks
    matplotlib.axes.Axes.set_xticks = (lambda self, t, labels=None, **k: ticks.append(labels)
                                       or real_ticks(self, t, labels, **k))
    try:
        plot.main(["--compare", f"{s2},{e2}", "--compare", f"{s0},{e0}", "--out", str(out)])
    finally:
        matplotlib.axes.Axes.set_xticks = real_ticks
    assert ticks[-1] == ["overall\n(4/8 tasks)", "depth_1\n(4 tasks)", "depth_2\n(4 tasks)"]
    for args, needle in [(["--compare", f"{s0},{e0}"], "needs --out"),
                         ([str(tmp_path), "--compare", f"{s0},{e0}", "--out", str(out)],
                          "one of the three"),
                         (["--compare", f"{s0},{tmp_path}/none.json", "--out", str(out)],
                          "no file"),
                         (["--compare", f"{s0},{e0}", "--out", str(out), "--labels", "a,b"],
                          "2 names for 1"),
                         ([], "give run folders")]:
        res = subprocess.run([sys.executable, "-m", "tools.plot", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and needle in res.stderr, (args, res.stderr)


def test_a_live_runs_half_written_last_line_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "succ')
    assert plot.read_jsonl(str(path)) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"step": 2, "succ\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not JSON"):
        plot.read_jsonl(str(path))


def test_held_out_curves_of_eval_results_make_a_png_and_bad_input_names_itself(tmp_path):
    def result(name, scores):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tasks": [{"item_id": i, "scores": s}
                                              for i, s in enumerate(scores)]}))
        return str(path)

    s0, s1 = result("s0", [[0.0], [0.0], [1.0], [0.0]]), result("s1", [[0.0], [0.0], [1.0], [1.0]])
    a, b = result("a", [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]), result("b", [[1.0]] * 4)
    # start: per task 0, 0, 1, 0.5 -> 37.5%; a: 0.5, 0, 1, 1 -> 62.5%, changes 0.5, 0, 0, 0.5
    # (se 0.144)
    points = plot.curve_points(f"0={s0}+{s1},10={a},20={b}")
    assert [(s, round(100 * y, 1)) for s, y, _, _ in points] == [(0, 37.5), (10, 62.5), (20, 100.0)]
    assert points[0][2] == points[0][3] == points[0][1]  # the first point: no bar
    assert [round(100 * x, 1) for x in points[1][2:]] == [34.2, 90.8]  # 37.5 + 25 -/+ 1.96 * 14.43
    out = tmp_path / "curve.png"
    plot.main(["--curve", f"0={s0}+{s1},10={a},20={b}", "--curve", f"0={s0},20={b}",
               "--out", str(out), "--labels", "seed 0,seed 1"])
    assert out.stat().st_size > 0
    for args, needle in [(["--curve", f"0={s0},10={a}"], "needs --out"),
                         (["--curve", f"0={s0}", "--out", str(out)], "two or more points"),
                         (["--curve", f"x={s0},10={a}", "--out", str(out)], "two or more points"),
                         (["--curve", f"10={s0},0={a}", "--out", str(out)], "must increase"),
                         (["--curve", f"0={s0},10={tmp_path}/none.json", "--out", str(out)],
                          "no file"),
                         (["--curve", f"0={s0},10={a}", "--compare", f"{s0},{a}",
                           "--out", str(out)],
                          "one of the three")]:
        res = subprocess.run([sys.executable, "-m", "tools.plot", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and needle in res.stderr, (args, res.stderr)
