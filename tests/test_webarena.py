"""WebArena through AgentGym's WebArena server protocol, against the stand-in of
agentgym_webarena.py: the client's dialect (env_idx ids, observation after reset,
terminated/truncated, reward only at the end, plain-text answers), client-side action-block parsing,
task lists for a server without /tasks, and eval.py and train.py end to end. The real sites, browser
and evaluators are not run here."""

import json
import os
import re
import subprocess
import sys

import pytest
from agentgym_webarena import MAX_STEPS, SOLUTIONS, TASKS, create_app
from conftest import ROOT
from flask import Flask, jsonify, request

import eval as ev
from env_server.agents import WEBARENA_NO_ACTION, parse_action
from env_client import EnvClient, EnvError, EnvPool, _step_from
from tasks import task_splits
from env_server.app import serve_wsgi_in_thread


@pytest.fixture
def webarena_url():
    url, stop = serve_wsgi_in_thread(create_app())
    yield url
    stop()


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.json"
    ids = list(range(len(TASKS)))
    path.write_text(json.dumps({"train": ids, "test": ids,
                                "categories": {"0": "shopping", "1": "shopping", "2": "info"}}))
    return str(path)


def test_client_speaks_the_webarena_dialect(webarena_url):
    c = EnvClient(webarena_url)
    assert c.id_key == "env_idx"
    first = c.reset(0)
    # The agent's observation is the rendered prompt, not /reset's bare page tree.
    assert ("OBJECTIVE: What is the price of the Blue Mug?" in first
            and "PREVIOUS ACTION: None" in first)
    s = c.step("Let's think. In summary, the next action I will perform is ```click [3]```")
    assert not s.done and s.reward == 0 and "Price: $12.50" in s.observation
    s = c.step("```stop [$12.50]```")
    assert s.done and s.reward == 1.0 and s.raw["terminated"] is True
    c.reset(1)
    s = c.step("```stop [$1]```")  # a wrong answer ends the episode with reward 0
    assert s.done and s.reward == 0.0
    c.close()  # the server answers a plain-text "closed"
    assert c.closed


def test_truncated_ends_the_episode_and_reward_counts_only_when_terminated(webarena_url):
    c = EnvClient(webarena_url)
    c.reset(2)
    steps = [c.step("```go_back```") for _ in range(MAX_STEPS)]
    assert [s.done for s in steps] == [False] * (MAX_STEPS - 1) + [True]
    assert _step_from({"observation": "o", "reward": 1.0, "terminated": False,
                       "truncated": True}).reward == 0.0
    assert _step_from({"observation": "o", "reward": 1.0, "terminated": True,
                       "truncated": False}).reward == 1.0


def test_reply_without_action_block_is_answered_by_the_client():
    p = parse_action("webarena", "I think I should click the mug.")
    assert p.action is None and p.error == WEBARENA_NO_ACTION
    reply = "Thinking. In summary, the next action I will perform is ```click [3]```"
    # the server parses the whole reply itself
    assert parse_action("webarena", reply).action == reply


def test_server_errors_are_env_errors(webarena_url):
    c = EnvClient(webarena_url)
    c.id = 99  # unknown there: an unhandled exception, HTTP 500 with an HTML page
    with pytest.raises(EnvError) as e:
        c.step("```click [3]```")
    assert e.value.kind == "http" and e.value.status == 500
    # no /batch (plain-text health): one request per instance
    with EnvPool(webarena_url, 2) as pool:
        assert pool.use_batch is False
        firsts = pool.reset([0, 1])
        assert "Blue Mug?" in firsts[0] and "Red Kettle?" in firsts[1]


def test_task_lists_without_a_tasks_endpoint(webarena_url, tasks_file, tmp_path):
    d = task_splits(webarena_url, "webarena", None)  # WebArena's 812 ids, every fifth one held out
    assert (len(d["splits"]["train"]) + len(d["splits"]["test"]) == 812
            and d["splits"]["test"][:3] == [0, 5, 10])
    assert not set(d["splits"]["train"]) & set(d["splits"]["test"])
    d = task_splits(webarena_url, "webarena", tasks_file)
    assert d["splits"]["test"] == [0, 1, 2] and d["categories"][2] == "info"
    with pytest.raises(ValueError, match="--tasks-file"):
        task_splits(webarena_url, "some_env", None)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--tasks-file .*bad.json"):
        task_splits(webarena_url, "webarena", str(bad))
    with pytest.raises(EnvError) as e:  # nothing listening: an error, not a guessed task list
        task_splits("http://127.0.0.1:9", "webarena", None)
    assert e.value.kind == "connection"


def scripted_chat_server(answer_blocks: bool = True):
    """An OpenAI-compatible chat endpoint playing the stand-in's tasks perfectly: it reads the
    objective and the previous action off the last user message and sends the next action of the
    solution."""
    app = Flask("scripted_chat")

    @app.post("/v1/chat/completions")
    def chat():
        pages = [m["content"] for m in request.get_json()["messages"]
                 if "OBJECTIVE:" in m["content"]]
        task = next(i for i, t in enumerate(TASKS) if t["intent"] in pages[-1])
        prev = re.search(r"PREVIOUS ACTION: (.*)", pages[-1]).group(1)
        plan = SOLUTIONS[task]
        action = plan[plan.index(prev) + 1] if prev in plan else plan[0]
        text = ("Let's think step by step. In summary, the next action I will perform is "
                f"```{action}```")
        if not answer_blocks:
            text = f"I will {action}."
        return jsonify({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "stop"}]})

    url, stop = serve_wsgi_in_thread(app)
    return url + "/v1", stop


@pytest.mark.parametrize("blocks", [True, False])
def test_eval_against_the_webarena_protocol(tmp_path, webarena_url, tasks_file, blocks):
    chat, stop = scripted_chat_server(answer_blocks=blocks)
    try:
        res = ev.main(ev.parse_args(["--env", "webarena", "--env-addr", webarena_url,
                                     "--tasks-file", tasks_file, "--endpoint", chat,
                                     "--endpoint-model", "scripted", "--n", "1",
                                     "--max-turns", "4", "--out", str(tmp_path / "wa.json")]))
    finally:
        stop()
    assert res["excluded"] == {"env_error": 0, "endpoint_error": 0}
    if blocks:
        assert res["overall"]["pass@1"] == 1.0 and set(res["by_category"]) == {"shopping", "info"}
        assert res["statuses"]["done"] == 3
    else:  # every reply is refused client-side; the browser is never stepped and nothing is won
        assert res["overall"]["pass@1"] == 0.0 and res["statuses"]["max_turns"] == 3
        with open(tmp_path / "wa.rollouts.jsonl") as f:
            t = json.loads(f.readline())
        assert t["messages"][4]["content"] == WEBARENA_NO_ACTION


def test_train_runs_against_the_webarena_protocol(tmp_path, webarena_url):
    import models.tiny as tiny_model

    tasks_file = tmp_path / "splits.json"  # training may not share ids with the held-out split
    tasks_file.write_text(json.dumps({"train": [0, 1], "test": [2]}))

    model = tiny_model.build(str(tmp_path / "tiny"), env_names=("corridor",), tokenizer="bpe",
                             vocab_size=300, layers=1, hidden=32, heads=2)
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "train.py", "--env", "webarena", "--env-addr", webarena_url,
                        "--tasks-file", str(tasks_file), "--model", model, "--steps", "1",
                        "--batch-size", "2", "--group-size", "2", "--schedule", "2",
                        "--max-new-tokens", "4", "--threads", "1", "--eval-every", "0",
                        "--no-dynamic-sampling", "--out", out], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "rollouts", "step_000001.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert len(rows) == 4 and all(t["status"] in ("done", "max_turns") for t in rows)
    assert all("OBJECTIVE:" in t["messages"][2]["content"] for t in rows)


@pytest.mark.parametrize("args,needle", [
    (["--env", "webarena"], "--env-addr"),
    (["--env", "webarena", "--env-addr", "http://127.0.0.1:9"], "--model"),
    (["--env", "nosuchenv"], "--env: unknown environment 'nosuchenv'"),
])
def test_train_names_what_webarena_needs(args, needle):
    r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr
