"""agents.py: each scheme's parsing on good and malformed replies, a plan that stays in context, a
reflect trajectory that resets its env between attempts and keeps every sampled token under the loss
mask, and the original release's item-id lists."""

import json
import time

import pytest
from conftest import sampled_runs
from test_rollout import ScriptedEngine, real_tokenizer

from env_server import agents
from env_server.agents import (ONE_ACTION_ERROR, PLAN_ASK, PLAN_GO, REFLECT_ASK, RESTART,
                               make_agent, parse_action, parse_last_action, parse_search_answer,
                               parse_thought_action)
from env_client import EnvPool
from tasks import item_id, read_tasks_file, task_splits
from env_server.app import serve_in_thread
from env_server.corridor import CorridorEnv
from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout


# ---------------------------------------------------------------- parsing, parser by parser
@pytest.mark.parametrize("reply,action", [
    ("Thought:\nI need logs.\n\nAction:\nget 1 oak log", "get 1 oak log"),
    ("Action: craft 4 oak planks using 1 oak log\nmore text", "craft 4 oak planks using 1 oak log"),
    ("Thought: ok\nAction:   inventory  ", "inventory"),
    ("Action: get 2 'dark' oak_log!!", "get 2 dark oaklog"),  # only [A-Za-z0-9, ] survive
    ("Action: go to red   ball 1.", "go to red ball 1"),
    ("I will just talk.", ""),
    ("", ""),
])
def test_thought_action_parsing(reply, action):
    assert parse_thought_action(reply).action == action
    assert parse_thought_action(reply).error is None


def test_one_action_rule():
    p = parse_thought_action("Action: get 1 stick\nAction: inventory")
    assert p.action is None and p.error == ONE_ACTION_ERROR
    assert parse_action("babyai", "Action: turn left\nAction: turn right").error == ONE_ACTION_ERROR


def test_other_parsers():
    assert (parse_last_action("Thought: x\nAction: open door\nAction: look around\n").action
            == "look around")
    assert parse_last_action("look around").action == "look around"
    assert parse_search_answer("<think>hm</think><search>who is x</search>"
                               "<answer>y</answer>").action == "<search>who is x</search>"
    assert parse_search_answer("no tags").action == ""
    assert parse_action("webarena", "so: ```click [12]```").action == "so: ```click [12]```"
    # no ``` block: refused client-side
    assert parse_action("webarena", "click [12]").action is None
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        parse_action("nope", "x")


@pytest.mark.parametrize("reply,action", [
    ("<search>a</answer><answer>b</answer>", "<answer>b</answer>"),  # the search never closes
    ("<search>a<answer>b</answer>c</search>", "<search>a<answer>b</answer>c</search>"),
    ("<answer>x</answer></answer>", "<answer>x</answer>"),
    ("x<search></search>", "<search></search>"),
    ("<search>\nq\n</search>", "<search>\nq\n</search>"),
    ("</search><search>", ""),
])
def test_search_answer_blocks(reply, action):
    assert parse_search_answer(reply).action == action


def test_search_answer_is_linear():
    """A regex with a lazy body retried from every unclosed tag took ~16 s on such a reply (the
    bound, 5 s, leaves room for a loaded machine; the linear parse takes milliseconds)."""
    for reply in ("<search>" * 12_500, "<answer><search>" * 6_250, "<search>x</answer>" * 6_000):
        t0 = time.perf_counter()
        assert parse_search_answer(reply).action == ""
        assert time.perf_counter() - t0 < 5.0
    assert parse_search_answer("<answer>" * 12_500 + "</answer>").action == "<answer>" * 12_500 \
        + "</answer>"


# ---------------------------------------------------------------- parsing, scheme by scheme
def test_react_parses_one_action_and_refuses_two():
    a = make_agent("react", "textcraft", 10)
    assert a.act("Thought: wood first.\nAction: get 1 oak log").action == "get 1 oak log"
    m = a.act("Action: get 1 oak log\nAction: inventory")
    assert m.action is None and m.note == ONE_ACTION_ERROR
    assert a.act("I will just chat.").action == ""  # no Action line: an empty action, as upstream
    # only [A-Za-z0-9, ] is kept
    assert a.act("Action: get 1 <oak> log!!").action == "get 1 oak log"
    assert a.observe("Got 1 oak log", 0.0, False, 1) == ("Got 1 oak log", None)
    assert a.observe("Crafted 1 stick", 1.0, True, 2) == ("Crafted 1 stick", "done")


def test_plan_writes_a_plan_first_then_acts():
    a = make_agent("plan", "textcraft", 10)
    opening = a.opening("Goal: craft stick.")
    assert (opening[-1]["content"] == f"Goal: craft stick.\n\n{PLAN_ASK}"
            and opening[0]["role"] == "user")
    # even with an Action line: a plan
    m = a.act("1. get logs\n2. craft planks\nAction: get 1 oak log")
    assert m.action is None and m.note == PLAN_GO
    assert a.act("Thought: step 1.\nAction: get 1 oak log").action == "get 1 oak log"
    # malformed later replies as react
    assert a.act("Action: a\nAction: b").note == ONE_ACTION_ERROR


def test_reflect_retries_after_a_failed_attempt():
    a = make_agent("reflect", "corridor", 8)
    assert a.attempt_turns == 3  # (8 - 1 reflection turn) // 2 attempts
    assert (a.observe("The goal is 2 steps to your left.", 0.0, False, 1)
            == ("The goal is 2 steps to your left.", None))
    a.observe("x", 0.0, False, 2)
    # its 3 turns are used
    text, outcome = a.observe("The goal is 4 steps to your left.", 0.0, False, 3)
    assert outcome == "retry" and text.endswith(REFLECT_ASK)
    a.restart("The goal is 1 step to your left.")
    # a reflection: never an action
    m = a.act("I walked the wrong way; I will go left.\nAction: right")
    assert m.action is None and m.note == f"{RESTART}\n\nThe goal is 1 step to your left."
    assert a.observe(m.note, None, False, 4) == (m.note, None)
    assert a.act("left").action == "left"
    for turn in (5, 6, 7):  # the last attempt has the rest of the turns, and no retry
        assert a.observe("The goal is 1 step to your left.", 0.0, False, turn)[1] is None
    assert a.observe("You reached the goal.", 1.0, True, 8)[1] == "done"


def test_reflect_retries_when_the_env_ends_an_attempt_without_reward():
    a = make_agent("reflect", "babyai", 20)
    assert a.observe("You died.", 0.0, True, 2)[1] == "retry"
    a.restart("again")
    a.act("reflection")
    a.observe("note", None, False, 3)
    # no attempts left: it ends
    assert a.observe("You died.", 0.0, True, 5) == ("You died.", "done")


def test_reflect_does_not_retry_without_turns_for_it():
    a = make_agent("reflect", "corridor", 4)  # attempt_turns = 1
    assert a.observe("no", 0.0, False, 3)[1] is None  # 3 + reflection + one action > 4 turns


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="unknown agent scheme 'cot'"):
        make_agent("cot", "textcraft", 5)
    assert sorted(agents.SCHEMES) == ["plan", "react", "reflect"]


# ----------------------------------------------------------- whole trajectories, on a real template
class Tracked(CorridorEnv):
    resets: list = []

    def reset(self, idx):
        Tracked.resets.append(idx)
        return super().reset(idx)


@pytest.fixture
def corridor_url():
    url, stop = serve_in_thread(Tracked)
    Tracked.resets = []
    yield url
    stop()


def play(url, scheme, replies, max_turns, task=1):
    fmt = ChatFormat(real_tokenizer("qwen2.5-instruct"))
    with EnvPool(url, 1) as pool:
        rcfg = RolloutConfig(max_turns=max_turns)
        (t,) = rollout(EnginePolicy(ScriptedEngine(fmt, replies), fmt, rcfg), pool, "corridor",
                       [task], [0], rcfg, fmt=fmt, agent=scheme)
    return fmt, t


def test_a_reflect_trajectory_resets_its_env_and_masks_every_reply(corridor_url):
    # Task 1: the goal is 1 step to the left. Attempt 1 walks right for its 3 turns, the agent
    # reflects, the env is reset to task 1, and attempt 2 steps left: reward 1, the last attempt's.
    replies = ["right", "right", "right", "I went right, away from the goal. Go left.", "left"]
    fmt, t = play(corridor_url, "reflect", replies, max_turns=8)
    assert Tracked.resets == [1, 1]
    assert t.status == "done" and t.reward == 1.0 and t.turns == 5 and t.agent == "reflect"
    assert t.template == "exact"
    users = [m["content"] for m in t.messages[3:] if m["role"] == "user"]
    assert (users[2].endswith(REFLECT_ASK)
            and users[3] == f"{RESTART}\n\nThe goal is 1 step to your left.")
    assert users[4] == "You reached the goal."
    # every reply, the reflection included, is under the loss mask, and nothing else is
    assert ([fmt.tok.decode(r) for r in sampled_runs(t)]
            == [fmt.tok.decode(fmt.encode(r) + [fmt.eot_id]) for r in replies])
    full = fmt.encode(fmt.tok.apply_chat_template(t.messages, tokenize=False,
                                                  add_generation_prompt=True))
    assert full[:len(t.token_ids)] == t.token_ids


def test_a_failed_last_attempt_scores_zero(corridor_url):
    fmt, t = play(corridor_url, "reflect", ["right"] * 3 + ["reflection"] + ["right"] * 4,
                  max_turns=8)
    assert Tracked.resets == [1, 1] and t.status == "max_turns" and t.reward == 0.0 and t.turns == 8


def test_a_plan_trajectory_keeps_its_plan_in_context(corridor_url):
    replies = ["1. go left once.", "left"]
    fmt, t = play(corridor_url, "plan", replies, max_turns=4)
    assert t.status == "done" and t.reward == 1.0 and t.turns == 2 and Tracked.resets == [1]
    assert ([m["content"] for m in t.messages[-4:]]
            == ["1. go left once.", PLAN_GO, "left", "You reached the goal."])
    assert len(sampled_runs(t)) == 2 and t.template == "exact"


# ---------------------------------------------------------------- the original release's item ids
def test_item_ids_in_every_form():
    assert item_id("textcraft", 7, 544) == 7
    assert item_id("textcraft", "textcraft_12", 544) == 12
    assert item_id("babyai", {"item_id": "babyai_3", "conversations": []}, 400) == 3
    for bad, why in [("babyai_3", "is for 'babyai', not 'textcraft'"),
                     ("textcraft_544", "no task 544"), ("textcraft_-1", "not of the form"),
                     ("textcraft", "not of the form"), (-1, "no task -1"),
                     (True, "must be an integer"), (2.0, "must be an integer"),
                     ({"id": 3}, "'item_id' field"), ("webshop_3", "is for 'webshop'")]:
        with pytest.raises(ValueError, match=why):
            item_id("textcraft", bad, 544)


def test_tasks_file_forms(tmp_path, corridor_url):
    f = tmp_path / "ids.json"
    # this project's own envs too
    f.write_text(json.dumps([{"item_id": "corridor_50"}, "corridor_2"]))
    assert read_tasks_file(str(f), "corridor", 60, "train")["splits"] == {"train": [50, 2]}
    f.write_text(json.dumps([{"item_id": "textcraft_5"}, "textcraft_2", 9]))
    assert read_tasks_file(str(f), "textcraft", 544, "test")["splits"] == {"test": [5, 2, 9]}
    # a bare list is the training split; the test split comes from the server
    f.write_text(json.dumps([3, 4]))
    d = task_splits(corridor_url, "corridor", str(f))
    assert d["splits"]["train"] == [3, 4] and d["splits"]["test"] == list(range(48, 60))
    f.write_text(json.dumps({"train": [1], "test": [60]}))
    with pytest.raises(ValueError,
                       match=r"--tasks-file .*corridor has no task 60 \(its tasks are 0..59\)"):
        task_splits(corridor_url, "corridor", str(f))
    for bad in ("{}", "3", '{"train": 5}', "[[1]]"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="--tasks-file"):
            task_splits(corridor_url, "corridor", str(f))


# --------------------------------------------------------- every scheme trains with every algorithm
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp", "ppo"])
@pytest.mark.parametrize("scheme", ["plan", "reflect"])
def test_each_scheme_trains_with_each_algorithm(tmp_path, cache_dir, scheme, algo):
    import train

    out = tmp_path / "run"
    cfg = train.parse_args(["--env", "corridor", "--agent", scheme, "--algo", algo, "--steps", "1",
                            "--schedule", "5", "--batch-size", "2", "--group-size", "2",
                            "--max-new-tokens", "4", "--threads", "1", "--eval-every", "0",
                            "--out", str(out), "--cache-dir", cache_dir])
    summary = train.main(cfg)
    assert summary["step"] == 1 and summary["skipped_update"] == 0 and "loss" in summary
    with open(out / "rollouts" / "step_000001.jsonl") as f:
        rows = [json.loads(x) for x in f]
    # the scheme's own turn and a move, unless the first move reached the goal (1 cell away)
    assert all(r["agent"] == scheme and (r["turns"] >= 2 or r["status"] == "done") for r in rows)
    if scheme == "plan":  # the plan turn is the first reply, sampled and under the mask
        assert all(r["messages"][4]["content"] == PLAN_GO for r in rows)
    else:  # 5 turns: 2 for the first attempt, a reflection, 2 for the second, unless a game
        # ended early
        assert any(REFLECT_ASK in m["content"] for r in rows for m in r["messages"]) or \
            any(r["status"] == "done" for r in rows)
