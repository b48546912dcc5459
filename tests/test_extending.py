"""Each extension point is one registration, made here from a test file, without touching train.py:
an advantage estimator, an environment, an agent scheme, a horizon schedule. A half-registered game
and an unknown name are refused with one message. docs/extending.md's game, as written there,
trains from a script of one's own."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from toy_env import CounterEnv

from conftest import ROOT

from env_server import agents
import algos
import scheduler
import train
from env_server.app import serve_in_thread

TINY = ["--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--threads", "1",
        "--eval-every", "0"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def train_run(tmp_path, cache_dir, *args) -> list[dict]:
    before = torch.get_num_threads()
    out = str(tmp_path / "run")
    try:
        train.main(train.parse_args([*TINY, *args, "--out", out, "--cache-dir", cache_dir]))
    finally:
        torch.set_num_threads(before)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def test_a_new_estimator_trains_without_touching_train_py(tmp_path, cache_dir, monkeypatch):
    # so that the registration is undone after the test
    monkeypatch.setitem(algos.ESTIMATORS, "sign", None)
    calls = []

    @algos.register_estimator("sign")
    def sign(x: algos.AdvantageInputs):
        """+1 on the tokens of a trajectory above its group's mean score, -1 below."""
        calls.append(x.scores.clone())
        mean = algos.grpo_advantages(x.scores, x.group_ids, norm_std=False)
        return torch.sign(mean)[:, None] * x.mask, None

    m = train_run(tmp_path, cache_dir, "--env", "corridor", "--algo", "sign", "--steps", "1",
                  "--schedule", "3")
    assert len(calls) == 1 and len(calls[0]) == 4  # one step, batch 2 x group 2
    # no critic asked for, none trained
    assert m[0]["step"] == 1 and "loss" in m[0] and "value_loss" not in m[0]


def test_an_unknown_estimator_is_refused_never_run_as_another(capsys):
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; "
                                         "registered: dr_grpo, gigpo, grpo"):
        algos.estimator("nope")
    with pytest.raises(SystemExit):
        train.parse_args(["--env", "corridor", "--algo", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_dr_grpo_is_grpo_without_the_std():
    x = algos.AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]),
                              torch.ones(4, 3))
    adv, returns = algos.estimator("dr_grpo").fn(x)
    assert returns is None and torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    grpo, _ = algos.estimator("grpo").fn(x)
    assert grpo[0, 0] > adv[0, 0]  # GRPO divides by the group's std (0.707 here)
    assert train.parse_args(["--env", "corridor", "--algo", "dr_grpo"]).algo == "dr_grpo"


def test_a_new_env_is_one_class_and_one_registration(tmp_path, cache_dir):
    """tests/toy_env.py's CounterEnv and its register_env call are all train.py needs."""
    url, stop = serve_in_thread(CounterEnv)
    try:
        m = train_run(tmp_path, cache_dir, "--env", "counter", "--env-addr", url, "--steps", "1",
                      "--schedule", "2")
    finally:
        stop()
    assert m[0]["step"] == 1 and m[0]["status_env_error"] == 0
    with open(tmp_path / "run" / "rollouts" / "step_000001.jsonl") as f:
        first = json.loads(f.readline())
    assert first["messages"][0]["content"] == agents.ENVS["counter"].instructions
    assert first["messages"][2]["content"].startswith("Reach ")


def test_a_half_registered_env_fails_at_start_up_with_one_message(monkeypatch, capsys):
    for name in ("half", "classless"):
        monkeypatch.setitem(agents.ENVS, name, None)
    agents.register_env("half", server=CounterEnv, instructions=None, parse_action=None)
    agents.register_env("classless", server="os.path:join", instructions="Play.",
                        parse_action=agents.parse_whole_reply)
    for name, needles in (("half", ["instructions", "parse_action"]),
                          ("classless", ["server class", "not a subclass"])):
        with pytest.raises(SystemExit) as stopped:
            train.parse_args(["--env", name])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert (all(n in err for n in needles)
                and f"environment {name!r} is registered without" in err)


def test_a_new_agent_scheme(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setitem(agents.SCHEMES, "terse", None)

    @agents.register_scheme
    class Terse(agents.React):
        name = "terse"

        def opening(self, first_observation):
            return agents.opening_messages(self.env, f"{first_observation}\nAnswer in one word.")

    train_run(tmp_path, cache_dir, "--env", "corridor", "--agent", "terse", "--steps", "1",
              "--schedule", "2")
    with open(tmp_path / "run" / "rollouts" / "step_000001.jsonl") as f:
        rows = [json.loads(x) for x in f]
    assert all(r["agent"] == "terse" and r["messages"][2]["content"].endswith("Answer in one word.")
               for r in rows)
    with pytest.raises(TypeError, match="subclass of agents.React"):
        agents.register_scheme(type("Loose", (), {"name": "loose"}))


def test_a_new_horizon_schedule(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setitem(scheduler.SCHEDULES, "shrinking", None)

    @scheduler.register_schedule("shrinking")
    def shrinking(rounds, every, **kw):
        return scheduler.StepwiseHorizon(sorted(rounds, reverse=True), every)

    m = train_run(tmp_path, cache_dir, "--env", "corridor", "--schedule", "2,3",
                  "--schedule-kind", "shrinking", "--steps", "2")
    assert [x["max_turns"] for x in m] == [3, 2]
    with pytest.raises(ValueError, match="unknown schedule kind 'nope'; "
                                         "registered: plateau, shrinking, step"):
        scheduler.make_schedule("2,3", 1, "nope")


def doc_block(page: str, needle: str) -> str:
    """The fenced Python block of docs/PAGE that holds `needle`, as written there."""
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"docs/{page}: {len(found)} python blocks hold {needle!r}"
    return found[0]


def test_the_docs_game_trains_from_a_script_of_ones_own(tmp_path, cache_dir):
    """docs/extending.md's MyGame, exec'd as written in a script that then calls train.main: the
    game is registered in that process only, so train.py serves it on a thread there (a `python -m
    env_server` child would not know it); the untrained policy's malformed actions are
    observations, not env errors, so both steps train and the held-out evaluation scores its one
    test task."""
    script = tmp_path / "mygame_train.py"
    script.write_text(doc_block("extending.md", "class MyGame") +
                      "\nimport sys\nimport train\ntrain.main(train.parse_args(sys.argv[1:]))\n")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(script), *TINY, "--env", "mygame", "--steps", "2",
                        "--schedule", "3", "--eval-every", "2", "--out", str(out),
                        "--cache-dir", cache_dir], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--env mygame is registered by this script" in r.stderr and "Traceback" not in r.stderr
    with open(out / "metrics.jsonl") as f:
        m = [json.loads(x) for x in f]
    assert [x["step"] for x in m] == [1, 2]
    assert all(x["status_env_error"] == 0 and "loss" in x for x in m), m
    rows = [json.loads(x) for x in open(out / "rollouts" / "step_000001.jsonl")]
    assert any("Invalid action" in msg["content"] for row in rows for msg in row["messages"])
    with open(out / "eval.jsonl") as f:
        evals = [json.loads(x) for x in f]
    assert [(e["step"], e["tasks"]) for e in evals] == [(0, 1), (2, 1)]


def test_the_stop_message_names_the_users_script_where_it_registered_its_own(monkeypatch):
    """A game or estimator registered in the user's own script is unknown to train.py: the hint
    names that script (which hands its arguments to train.parse_args)."""
    import algos
    from trainer.checkpoints import resume_command

    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    from env_server import agents

    monkeypatch.setattr(agents, "ENVS", dict(agents.BUILT_IN))  # what other tests registered:
    monkeypatch.setattr(algos, "ESTIMATORS", {k: e for k, e in algos.ESTIMATORS.items()  # out
                                              if e.fn.__module__ == "algos"})
    monkeypatch.setattr(sys, "argv", ["my_game.py", "--env", "corridor"])
    assert resume_command("runs/a") == "python train.py --resume --out runs/a"  # nothing of its own
    monkeypatch.setitem(algos.ESTIMATORS, "sign", algos.Estimator(lambda x: (x, None)))
    assert resume_command("runs/a") == "python my_game.py --resume --out runs/a"
