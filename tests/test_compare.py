"""eval.py --compare and its parts (tools/paired.py, tools/eval_outputs.py): two results task by
task, pooled seeds, the change by category, the behaviour table."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, exit_of

import eval as ev
from tools import eval_outputs, paired


def result(scores: dict) -> dict:
    """An eval.py result with these per-task scores (task id -> list of sample scores)."""
    return {"tasks": [{"item_id": i, "category": "all", "scores": s, "errors": 0}
                      for i, s in scores.items()]}


def test_compare_pairs_tasks_and_counts_the_changed_ones():
    # 20 tasks: 4 solved by both, 9 gained, 1 lost, 6 by neither; task 99 only in the end result
    start = {i: [1.0 if i < 4 or i == 4 else 0.0] for i in range(20)}
    end = {i: [1.0 if i < 4 or 5 <= i < 14 else 0.0] for i in range(20)}
    end[99] = [1.0]
    c = paired.compare(result(start), result(end))
    assert (c["tasks"], c["left_out"]) == (20, 1)
    assert (c["both"], c["gained"], c["lost"], c["neither"]) == (4, 9, 1, 6)
    assert (c["start"], c["end"], c["change"]) == pytest.approx((0.25, 0.65, 0.40))
    # sign test by hand: P(at most 1 of 10 changed tasks goes the other way) = 11/1024, doubled
    assert c["sign_test_p"] == pytest.approx(22 / 1024)
    d = [0.0] * 4 + [-1.0] + [1.0] * 9 + [0.0] * 6  # the per-task differences
    sd = (sum((x - 0.4) ** 2 for x in d) / 19) ** 0.5
    assert c["ci95"] == pytest.approx([0.4 - 1.96 * sd / 20 ** 0.5, 0.4 + 1.96 * sd / 20 ** 0.5])
    # no change at all: p = 1 and a zero-width interval at 0
    same = paired.compare(result(start), result(start))
    assert same["sign_test_p"] == 1.0 and same["ci95"] == pytest.approx([0.0, 0.0])


def test_compare_averages_samples_per_task_and_skips_the_sign_test_for_scores():
    c = paired.compare(result({1: [0.0, 1.0], 2: [0.5, 0.5]}),
                       result({1: [1.0, 1.0], 2: [0.25, 0.75]}))
    assert c["change"] == pytest.approx(0.25) and "sign_test_p" not in c


def test_behaviour_counts_turns_per_success_and_repeated_actions(capsys):
    from rollout import Trajectory

    def episode(actions, status, reward):
        replies = [{"role": "assistant",
                    "content": f"Thought: x.\nAction: {a}" if a else "no action here"}
                   for a in actions]
        opening = [{"role": "user", "content": "rules"},
                   {"role": "assistant", "content": "Action: ignored"},
                   {"role": "user", "content": "first"}]
        messages = opening + [m for r in replies for m in (r, {"role": "user", "content": "reply"})]
        return Trajectory("textcraft", 0, 0, messages, [], [], [], turns=len(actions),
                          status=status, reward=reward)

    won = episode(["get 1 log", "craft 4 planks using 1 log"], "done", 1.0)
    # 5 actions: the 2nd and 3rd repeat the one before; the reply without an action breaks the run
    lost = episode(["craft 1 door using 6 planks"] * 3
                   + [None, "craft 1 door using 6 planks", "get 1 log"],
                   "max_turns", 0.0)
    b = eval_outputs.behaviour([won, lost])
    assert b["turns_per_success"] == 2 and b["repeated_actions"] == pytest.approx(2 / 7)
    assert (eval_outputs.behaviour([lost])["turns_per_success"] is None
            and eval_outputs.behaviour([]) == {"turns_per_success": None,
                                               "repeated_actions": None})
    eval_outputs.print_table({"n_scored": 1, "by_category": {},
                              "overall": {"tasks": 2, "avg@1": 0.5, "pass@1": 0.5},
                              "statuses": {}, "excluded": {"env_error": 0, "endpoint_error": 0},
                              "behaviour": b})
    assert ("episodes: 2.0 turns per success, 29% of actions repeat the one before"
            in capsys.readouterr().out)


def test_compare_breaks_the_change_down_by_category(capsys):
    def res(scores):  # tasks 0-3 category "a", 4-5 category "b"
        return {"tasks": [{"item_id": i, "category": "a" if i < 4 else "b", "scores": s}
                          for i, s in scores.items()]}
    start = res({0: [0.0], 1: [0.0], 2: [1.0], 3: [0.0], 4: [1.0], 5: [1.0]})
    end = res({0: [1.0], 1: [1.0], 2: [1.0], 3: [1.0], 4: [0.0], 5: [1.0]})
    c = paired.compare(start, end)
    assert c["change"] == pytest.approx(2 / 6)
    a, b = c["by_category"]["a"], c["by_category"]["b"]
    assert (a["tasks"], a["start"], a["end"], a["change"]) == pytest.approx((4, 0.25, 1.0, 0.75))
    assert (b["tasks"], b["start"], b["end"], b["change"]) == pytest.approx((2, 1.0, 0.5, -0.5))
    sd = ((3 * 0.25 ** 2 + 0.75 ** 2) / 3) ** 0.5  # category a's differences 1, 1, 0, 1
    assert a["ci95"] == pytest.approx([0.75 - 1.96 * sd / 2, 0.75 + 1.96 * sd / 2])
    paired.print_comparison(c, "s.json", "e.json")
    assert ("b                      2 tasks  1.000 -> 0.500   -50.0 points"
            in capsys.readouterr().out)
    # one category: no breakdown
    assert "by_category" not in paired.compare(result({1: [0.0]}), result({1: [1.0]}))


def test_compare_from_the_command_line(tmp_path, capsys):
    """eval.py --compare prints the comparison; a bad --compare is refused by its parse_args (exit
    2, nothing on stdout): the first as eval.py's user sees it, the rest in this process."""
    a, b, bad = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "bad.json"
    a.write_text(json.dumps(result({i: [float(i < 3)] for i in range(10)})))
    b.write_text(json.dumps(result({i: [float(i < 6)] for i in range(10)})))
    bad.write_text(json.dumps({"success_rate": 0.5}))
    no_scores, babyai, apart = (tmp_path / f"{n}.json" for n in ("no_scores", "babyai", "apart"))
    no_scores.write_text(json.dumps({"tasks": [{"item_id": 0}]}))
    babyai.write_text(json.dumps({**result({i: [1.0] for i in range(10)}),
                                  "config": {"env": "babyai", "split": "test"}}))
    a.write_text(json.dumps({**json.loads(a.read_text()),
                             "config": {"env": "textcraft", "split": "test"}}))
    apart.write_text(json.dumps(result({i: [1.0] for i in range(10, 20)})))
    out = subprocess.run([sys.executable, "eval.py", "--compare", f"{a},{b}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "change +30.0 points" in out.stdout and "3 tasks gained, 0 lost" in out.stdout
    for arg, needle in [(f"{a}", "give two result files"), (f"{a},{tmp_path}/none.json", "no file"),
                        (f"{a},{bad}", "not a result of eval.py"),
                        (f"{a},{no_scores}", "not a result of eval.py"),
                        (f"{a},{babyai}", "different envs or splits"),
                        (f"{a},{b}+{babyai}", "different envs or splits"),
                        (f"{a},{apart}", "no task is in both sides")]:
        if arg == f"{a}":
            out = subprocess.run([sys.executable, "eval.py", "--compare", arg], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
            assert (out.returncode == 2 and needle in out.stderr
                    and out.stdout == ""), (arg, out.stderr)
            continue
        code, out, err = exit_of(lambda: ev.main(ev.parse_args(["--compare", arg])), capsys)
        assert code == 2 and needle in err and out == "", (arg, err)


def test_compare_pools_the_results_on_each_side(tmp_path, capsys):
    paths = {}
    for name, scores in {"a0": {1: [0.0], 2: [1.0], 3: [0.0]},
                         "a1": {1: [1.0], 2: [1.0], 3: [0.0]},
                         "b0": {1: [1.0], 2: [1.0], 3: [1.0]},
                         "b1": {1: [1.0], 2: [0.0], 3: [1.0]}}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(result(scores)))
    c = ev.main(ev.parse_args(["--compare",
                               f"{paths['a0']}+{paths['a1']},{paths['b0']}+{paths['b1']}"]))
    # per task, start 0.5 / 1 / 0 and end 1 / 0.5 / 1: changes +0.5, -0.5, +1
    assert (c["tasks"], c["start"], c["end"], c["change"]) == pytest.approx(
        (3, 0.5, 2.5 / 3, 1 / 3))
    assert "sign_test_p" not in c  # pooled scores are not one 0/1 sample per task
    arg = f"{paths['a0']}+{tmp_path}/no.json,{paths['b0']}"  # eval.py's exit: the test above
    code, _, err = exit_of(lambda: ev.parse_args(["--compare", arg]), capsys)
    assert code == 2 and "no file" in err
