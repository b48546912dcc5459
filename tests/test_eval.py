"""eval.py: Avg@n / Pass@n against hand counts, a checkpoint evaluated end to end as a subprocess,
and the OpenAI-compatible endpoint path against a fake chat server (right answers, and HTTP 500
counted as errors)."""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from flask import Flask, jsonify

from env_server import agents
import eval as ev
from env_client import EnvError
from env_server.app import ServerProcess, serve_wsgi_in_thread
from rollout import RandomPolicy
from tools import eval_outputs


def test_score_table_against_hand_count():
    rows = [  # 3 tasks x 2 samples, two categories; (..., score, success)
        (10, "a", 0, 1.0, True), (10, "a", 1, 0.0, False),  # mean 0.5, passed
        (11, "a", 0, 0.0, False), (11, "a", 1, 0.0, False),  # mean 0,   failed
        (20, "b", 0, 0.5, False), (20, "b", 1, 1.0, True),  # mean 0.75, passed
        # a score above 0 in an episode the env did not end (cut at K) is no success
        (30, "c", 0, 0.5, False), (30, "c", 1, 0.0, False),  # mean 0.25, failed
    ]
    t = ev.score_table(rows)
    assert t["n"] == 2
    assert t["overall"]["tasks"] == 4 and t["overall"]["samples"] == 8
    assert t["overall"]["avg@2"] == pytest.approx((0.5 + 0.0 + 0.75 + 0.25) / 4)
    assert t["overall"]["pass@2"] == pytest.approx(2 / 4)
    assert t["by_category"]["c"]["pass@2"] == 0.0
    assert t["by_category"]["a"]["avg@2"] == pytest.approx(0.25)
    assert t["by_category"]["a"]["pass@2"] == pytest.approx(0.5)
    assert t["by_category"]["b"] == {"tasks": 1, "samples": 2, "avg@2": pytest.approx(0.75),
                                     "pass@2": 1.0}


def test_score_table_weighs_every_task_alike_whatever_its_errors_left():
    """Avg@n is the mean over tasks of each task's mean: a task left with one scored sample (its
    others were errors, not scored 0) weighs as much as one with all n. By hand: task 1 scores
    1.0 and 1.0, task 2 keeps one 0.0 of its two -> Avg@2 = (1.0 + 0.0) / 2 = 0.5 (per sample it
    would be 2/3)."""
    rows = [(1, "a", 0, 1.0, True), (1, "a", 1, 1.0, True),
            (2, "a", 1, 0.0, False),  # sample 0 was an env error
            (3, "b", 0, 0.25, False)]  # a category of one task, one sample of two
    t = ev.score_table(rows)
    assert t["n"] == 2 and t["overall"]["tasks"] == 3 and t["overall"]["samples"] == 4
    assert t["overall"]["avg@2"] == pytest.approx((1.0 + 0.0 + 0.25) / 3)
    assert t["overall"]["pass@2"] == pytest.approx(1 / 3)
    assert t["by_category"]["a"] == {"tasks": 2, "samples": 3, "avg@2": pytest.approx(0.5),
                                     "pass@2": pytest.approx(0.5)}
    assert t["by_category"]["b"]["avg@2"] == pytest.approx(0.25)


def test_categories_come_from_the_env():
    cats = ev.categories_for("corridor", [48, 50, 52, 54])
    assert cats == {48: "distance_3", 50: "distance_3", 52: "distance_3",
                    54: "distance_3"}  # test games only
    assert ev.categories_for("webarena", [0, 1]) == {0: "all", 1: "all"}


def test_greedy_forces_n_to_one(capsys):
    cfg = ev.parse_args(["--env", "corridor", "--greedy", "--n", "4"])
    assert cfg.n == 1 and cfg.temperature == 0.0
    assert "n forced from 4 to 1" in capsys.readouterr().out


def test_checkpoint_eval_matches_hand_count(tmp_path):
    run, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    cmd = [sys.executable, "train.py", "--env", "corridor", "--steps", "1", "--batch-size", "2",
           "--group-size", "2", "--max-new-tokens", "4", "--schedule", "3", "--threads", "1",
           "--out", run, "--cache-dir", cache]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res_path = os.path.join(run, "eval.json")
    cmd = [sys.executable, "eval.py", "--env", "corridor", "--checkpoint", run, "--n", "2",
           "--limit", "4", "--max-turns", "6", "--max-new-tokens", "4", "--threads", "1",
           "--cache-dir", cache, "--out", res_path]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "overall" in out.stdout and "avg@2" in out.stdout
    res = json.load(open(res_path))
    with open(os.path.join(run, "eval.rollouts.jsonl")) as f:  # named after --out
        trajs = [json.loads(x) for x in f]
    assert len(trajs) == 8 and all(t["status"] in ("done", "max_turns") for t in trajs)
    assert all(t["turns"] <= 6 for t in trajs)
    by_item: dict = {}
    for t in trajs:
        by_item.setdefault(t["item_id"], []).append((t["reward"], t["status"] == "done"))
    assert sorted(by_item) == [48, 49, 50, 51] and all(len(s) == 2 for s in by_item.values())
    avg = sum(sum(r for r, _ in s) / 2 for s in by_item.values()) / 4
    # one success rule with training: the env ended the episode with a score above 0
    passed = sum(any(r > 0 and done for r, done in s) for s in by_item.values()) / 4
    assert res["overall"]["avg@2"] == pytest.approx(avg)
    assert res["dtype"] == "float32"  # --dtype auto: the tiny model is too small for bf16
    assert res["overall"]["pass@2"] == pytest.approx(passed)
    # the test tasks: distance 3, which no training task has
    assert set(res["by_category"]) == {"distance_3"}
    assert res["statuses"]["done"] + res["statuses"]["max_turns"] == 8
    assert res["excluded"] == {"env_error": 0, "endpoint_error": 0}
    assert res["config"]["checkpoint"] == run


def fake_chat_server(status: int = 200):
    """An OpenAI-compatible /v1/chat/completions that always answers "Action: right" (or fails)."""
    app = Flask("fake_chat")
    seen = []

    @app.post("/v1/chat/completions")
    def chat():
        from flask import request
        body = request.get_json()
        seen.append(body)
        if status != 200:
            return jsonify({"error": "boom"}), status
        return jsonify({"choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": "Action: right"},
                                     "finish_reason": "stop"}]})

    url, stop = serve_wsgi_in_thread(app)
    return url + "/v1", stop, seen


@pytest.fixture(scope="module")
def corridor_url():
    with ServerProcess("corridor") as server:
        yield server.url


def test_endpoint_answering_right(tmp_path, corridor_url):
    url, stop, seen = fake_chat_server()
    try:
        out = str(tmp_path / "ep.json")
        res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url,
                                     "--endpoint", url, "--endpoint-model", "fake", "--n", "2",
                                     "--limit", "6", "--max-turns", "5", "--out", out]))
    finally:
        stop()
    # Corridor test task i: goal on the right iff i is even, at distance 3 <= 5 = K.
    scores = {t["item_id"]: t["scores"] for t in res["tasks"]}
    assert sorted(scores) == list(range(48, 54))
    for item, s in scores.items():
        assert s == ([1.0, 1.0] if item % 2 == 0 else [0.0, 0.0]), item
    assert res["statuses"] == {"done": 6, "max_turns": 6, "context_limit": 0, "env_error": 0}
    assert (res["overall"]["avg@2"] == pytest.approx(0.5)
            and res["overall"]["pass@2"] == pytest.approx(0.5))
    # The same messages as training: instruction, acknowledgement, first observation, then the
    # dialogue.
    first = seen[0]
    assert (first["model"] == "fake" and first["messages"][0]["content"] ==
            agents.opening_messages("corridor", "x")[0]["content"])
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "user"]
    with open(tmp_path / "ep.rollouts.jsonl") as f:
        trajs = [json.loads(x) for x in f]
    assert len(trajs) == 12 and all(t["messages"][3]["content"] == "Action: right" for t in trajs)


def test_endpoint_http_500_is_an_error_not_a_zero(tmp_path, corridor_url):
    url, stop, seen = fake_chat_server(status=500)
    try:
        res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url,
                                     "--endpoint", url, "--endpoint-model", "fake", "--n", "2",
                                     "--limit", "2", "--max-turns", "3", "--endpoint-retries", "1",
                                     "--out", str(tmp_path / "ep.json")]))
    finally:
        stop()
    assert res["excluded"] == {"env_error": 0, "endpoint_error": 4}
    assert (res["statuses"]["env_error"] == 4
            and res["statuses"]["done"] == res["statuses"]["max_turns"] == 0)
    # nothing scored, not scored 0
    assert res["overall"]["tasks"] == 0 and res["overall"]["samples"] == 0
    assert all(t["scores"] == [] and t["errors"] == 2 for t in res["tasks"])
    assert len(seen) == 4 * 2  # each request tried once more, then counted


@pytest.mark.parametrize("answer", [b"garbage\r\n\r\n",  # no HTTP status line
                                    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}"])  # cut
def test_endpoint_answering_nonsense_is_an_error_not_a_crash(answer):
    """A server whose answer is not HTTP, or is cut short: http.client's own errors, which are not
    OSErrors, come out as the endpoint's error after the retries. (The server counts a request
    once it has closed its connection, which may be after the client has given up on it: the count
    is read once the server's thread has ended, not raced against it.)"""
    import socket
    import threading

    from tools.endpoint import ChatEndpoint

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    served = []

    def serve():
        for _ in range(2):  # the request and its one retry
            conn, _ = sock.accept()
            conn.recv(65536)
            conn.sendall(answer)
            conn.close()
            served.append(1)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    ep = ChatEndpoint(f"http://127.0.0.1:{sock.getsockname()[1]}", "m", 1.0, 1.0, 8, timeout_s=5,
                      retries=1)
    with pytest.raises(EnvError) as e:
        ep.chat([{"role": "user", "content": "hi"}])
    server.join(60)  # both answered and closed; without a retry it waits in accept: 1 served
    sock.close()
    assert e.value.kind == "endpoint" and len(served) == 2


def raw_server(answer):
    """A socket server on a daemon thread: `answer(conn)` writes each connection's answer after its
    request is read. Returns (base URL, the number of requests served so far: a list)."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    served = []

    def serve():
        while True:
            conn, _ = sock.accept()
            with conn:
                conn.recv(65536)
                served.append(1)
                with contextlib.suppress(OSError):  # the client may hang up first
                    answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", served


def chat_answer(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\n{extra}Connection: close\r\n\r\n").encode() + body


def right_answer(pad: int = 0) -> bytes:
    return json.dumps({"choices": [{"message": {"content": "Action: right" + " " * pad}}]}).encode()


@pytest.mark.parametrize("head", [False, True])  # the body trickles, or the status line already
def test_endpoint_deadline_holds_however_slowly_the_answer_trickles(head):
    """A byte every 0.05 s: each read is quick, so a socket timeout alone never fires (a 3 s
    timeout once took 94 s); the whole attempt ends at its deadline. The bound, 20 s, leaves a
    loaded machine room: the answer takes over 100 s to trickle in."""
    from tools.endpoint import ChatEndpoint

    whole = chat_answer(right_answer(pad=2000))

    def trickle(conn):
        sent = 0 if head else whole.index(b"\r\n\r\n") + 4
        conn.sendall(whole[:sent])
        for i in range(sent, len(whole)):
            conn.sendall(whole[i:i + 1])
            time.sleep(0.05)

    url, served = raw_server(trickle)
    ep = ChatEndpoint(url, "m", 1.0, 1.0, 8, timeout_s=1.0, retries=1)
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        ep.chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 20  # two attempts of 1 s, and the pause between them
    assert e.value.kind == "endpoint" and "within the 1 s deadline" in str(e.value)
    # the server takes the retry once it has seen the first trickle's client hang up, which on a
    # loaded machine may be after the retry's own deadline: its count is waited for
    deadline = time.monotonic() + 60
    while len(served) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(served) == 2


def test_endpoint_answers_are_bounded_in_size_redirects_and_nesting():
    from tools.endpoint import ChatEndpoint

    def ask(answer, **kw):
        url, served = raw_server(lambda conn: conn.sendall(answer))
        ep = ChatEndpoint(url, "m", 1.0, 1.0, 8, timeout_s=5, retries=1, **kw)
        try:
            return ep.chat([{"role": "user", "content": "hi"}]), served
        except EnvError as e:
            return e, served

    # a 3 KB answer: too long for 2 KB, fine for 4 KB
    big = chat_answer(right_answer(pad=3000))
    e, served = ask(big, max_answer_bytes=2048)
    assert e.kind == "endpoint" and "answer over 2048 bytes" in str(e) and len(served) == 2
    assert ask(big, max_answer_bytes=4096)[0].startswith("Action: right")
    # a redirect is the endpoint's error, not followed and not retried
    target, reached = raw_server(lambda conn: conn.sendall(chat_answer(right_answer())))
    e, served = ask(chat_answer(b"", "302 Found", f"Location: {target}/chat/completions\r\n"))
    assert (e.kind, e.status) == ("endpoint", 302) and "redirect" in str(e)
    assert len(served) == 1 and reached == []
    # JSON nested deeper than the parser's stack: a malformed answer, not a RecursionError
    e, served = ask(chat_answer(b"[" * 100_000))
    assert e.kind == "endpoint" and "malformed answer (RecursionError" in str(e)


def test_endpoint_answering_too_deep_counts_as_errors_in_eval(tmp_path, corridor_url):
    url, served = raw_server(lambda conn: conn.sendall(chat_answer(b"[" * 100_000)))
    res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url, "--endpoint", url,
                                 "--endpoint-model", "fake", "--limit", "2", "--n", "1",
                                 "--endpoint-retries", "0", "--out", str(tmp_path / "ep.json")]))
    assert res["excluded"] == {"env_error": 0, "endpoint_error": 2} and len(served) == 2
    assert res["overall"]["samples"] == 0  # left out, not scored 0


def test_endpoint_address_and_answer_size_flags_are_checked(capsys):
    for argv, needle in [(["--endpoint", "host:8000/v1"], "--endpoint: bad endpoint address"),
                         (["--endpoint", "http://h:99999/v1"], "Port out of range"),
                         (["--endpoint", "http://h/v1", "--endpoint-max-answer-kb", "0"],
                          "--endpoint-max-answer-kb must be at least 1"),
                         (["--endpoint", "http://h/v1", "--endpoint-max-context-kb", "0"],
                          "--endpoint-max-context-kb must be at least 1")]:
        with pytest.raises(SystemExit):
            ev.parse_args(["--env", "corridor", "--endpoint-model", "m", *argv])
        assert needle in capsys.readouterr().err


def test_a_seed_past_64_bits_is_refused_in_one_line(capsys):
    """torch's generators take no more: once a traceback, after the server had started."""
    with pytest.raises(SystemExit) as e:
        ev.parse_args(["--env", "corridor", "--seed", str(2 ** 64)])
    assert e.value.code == 2 and "--seed 18446744073709551616: a seed must fit in 64 bits" in \
        capsys.readouterr().err
    assert ev.parse_args(["--env", "corridor", "--seed", str(2 ** 64 - 1)]).seed == 2 ** 64 - 1


def test_an_out_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    """Once a traceback from makedirs, after the model had loaded."""
    (tmp_path / "somefile").write_text("")
    with pytest.raises(SystemExit) as e:
        ev.parse_args(["--env", "corridor", "--out", str(tmp_path / "somefile" / "r.json")])
    assert e.value.code == 2 and (f"--out {tmp_path / 'somefile' / 'r.json'}: "
                                  f"{tmp_path / 'somefile'} is a file, not a folder"
                                  in capsys.readouterr().err)


def fake_run(folder, **settings):
    """A run folder as eval.py reads it: config.json (train.py's fields) and checkpoint/model/
    (a weights file whose header reads)."""
    import torch
    from safetensors.torch import save_file

    import train

    model = os.path.join(folder, "checkpoint", "model")
    os.makedirs(model)
    save_file({"w": torch.zeros(1)}, os.path.join(model, "model.safetensors"))
    cfg = {**vars(train.config.Config()), "env": "corridor", "schedule": "2,5", "max_new_tokens": 6,
           "max_context": 512, "temperature": 0.7, "top_p": 0.9, "out": str(folder), "lr": 3e-4,
           **settings}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def test_a_checkpoint_is_played_with_its_runs_settings_unless_flags_say_otherwise(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    cfg = ev.parse_args(["--checkpoint", run])
    assert (cfg.env, cfg.max_turns, cfg.max_new_tokens, cfg.max_context, cfg.temperature,
            cfg.top_p, cfg.agent) == \
        ("corridor", 5, 6, 512, 0.7, 0.9, "react")  # K: the schedule's largest stage
    assert "from " + run + "/config.json: env corridor" in capsys.readouterr().out
    cfg = ev.parse_args(["--checkpoint", run, "--max-turns", "9", "--temperature", "1",
                         "--max-new-tokens", "64"])
    assert (cfg.max_turns, cfg.temperature, cfg.max_new_tokens,
            cfg.max_context) == (9, 1.0, 64, 512)
    cfg = ev.parse_args(["--checkpoint", fake_run(tmp_path / "other", eval_turns=3)])
    assert cfg.max_turns == 3  # the horizon the run's own evaluations played


def test_config_of_a_training_run_skips_its_training_fields_in_one_note(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    cfg = ev.parse_args(["--config", os.path.join(run, "config.json")])
    assert (cfg.env, cfg.max_turns, cfg.max_new_tokens, cfg.temperature) == ("corridor", 5, 6, 0.7)
    assert cfg.out == "eval_corridor_test.json"  # the run's out is a folder, not where results go
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fields eval.py does not use, skipped:" in err[0]
    assert "algo" in err[0] and "out (the run folder)" in err[0] and "env," not in err[0]


def fake_chat_server_each_way():
    """A chat endpoint whose first episode of each game walks right and whose second walks left: the
    reply to an opening goes by how often that opening was seen, a later reply repeats the episode's
    last move. Each reachable Corridor task is then won by exactly one of two samples."""
    import threading

    app, seen, lock = Flask("fake_chat_each_way"), {}, threading.Lock()

    @app.post("/v1/chat/completions")
    def chat():
        from flask import request
        messages = request.get_json()["messages"]
        if len(messages) == 3:  # the opening: instruction, acknowledgement, first observation
            with lock:
                k = seen[messages[2]["content"]] = seen.get(messages[2]["content"], -1) + 1
            move = "Action: right" if k % 2 == 0 else "Action: left"
        else:
            move = messages[-2]["content"]
        return jsonify({"choices": [{"index": 0, "message": {"role": "assistant", "content": move},
                                     "finish_reason": "stop"}]})

    url, stop = serve_wsgi_in_thread(app)
    return url + "/v1", stop


def test_curriculum_keeps_the_tasks_solved_only_sometimes(tmp_path, corridor_url, capsys):
    url, stop = fake_chat_server_each_way()
    path = str(tmp_path / "sometimes.json")
    try:
        # Training tasks 0-5 put the goal 1, 1, 2, 2, 4, 4 cells away; with K = 3 the last two are
        # never reached.
        res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url,
                                     "--endpoint", url, "--endpoint-model", "fake",
                                     "--split", "train", "--n", "2", "--limit", "6",
                                     "--max-turns", "3", "--out", str(tmp_path / "r.json"),
                                     "--curriculum", path]))
    finally:
        stop()
    assert {t["item_id"]: sorted(t["scores"]) for t in res["tasks"]} == \
        {0: [0.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 1.0], 3: [0.0, 1.0], 4: [0.0, 0.0], 5: [0.0, 0.0]}
    assert json.load(open(path)) == [0, 1, 2, 3]
    assert "4 of 6 tasks solved only sometimes" in capsys.readouterr().out
    from trainer.cli import task_lists
    # what train.py --tasks-file trains on
    splits = task_lists(corridor_url, "corridor", path)["splits"]
    assert splits["train"] == [0, 1, 2, 3] and splits["test"] == list(range(48, 60))


def test_curriculum_with_no_task_between_writes_nothing(tmp_path):
    path = tmp_path / "none.json"
    tied = {"tasks": [{"item_id": 1, "scores": [1.0, 1.0]}, {"item_id": 2, "scores": [0.0, 0.0]},
                      {"item_id": 3, "scores": [1.0]}]}  # task 3: one sample left after an error
    with pytest.raises(SystemExit, match="no task of the 2 with 2 or more scored samples"):
        eval_outputs.write_curriculum(tied, str(path))
    assert not path.exists()
    assert eval_outputs.sometimes_solved({"tasks": [{"item_id": 7, "scores": [0.25, 0.5]},
                                                    *tied["tasks"]]}) == [7]


@pytest.mark.parametrize("argv, needle", [
    (["--n", "1", "--split", "train"], "needs --n 2 or more"),
    (["--greedy", "--split", "train"], "needs sampled episodes"),
    (["--n", "4"], "estimate it on the training split"),
])
def test_curriculum_flags_are_checked_first(tmp_path, argv, needle):
    out = subprocess.run([sys.executable, "eval.py", "--env", "corridor",
                          "--curriculum", str(tmp_path / "c.json"), *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and needle in out.stderr and out.stdout == "", out.stderr
    assert os.listdir(tmp_path) == []


def test_a_cut_evaluation_continues_as_the_uncut_one(tmp_path, corridor_url, monkeypatch, capsys):
    # 6 tasks x 2 samples on 4 env instances: 3 chunks; the cut comes as the third starts.
    args = ["--env", "corridor", "--env-addr", corridor_url, "--limit", "6", "--n", "2",
            "--batch", "4", "--max-turns", "4", "--max-new-tokens", "4", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache")]
    whole = ev.main(ev.parse_args([*args, "--out", str(tmp_path / "whole" / "r.json")]))
    out = str(tmp_path / "cut" / "r.json")
    from trainer import held_out as played_by  # the player eval.py shares with training

    real, calls = played_by.rollout, []

    def counted(*a, **k):  # one call per chunk; the third of the first run is cut
        if isinstance(a[0], RandomPolicy):  # chance's chunks, after the policy's: not counted
            return real(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(played_by, "rollout", counted)
    with pytest.raises(SystemExit) as stopped:
        ev.main(ev.parse_args([*args, "--out", out]))
    assert stopped.value.code == 130 and capsys.readouterr().err.endswith(
        f"Ctrl-C: stopped; 8 episodes kept in {out}.partial.jsonl: the same command continues "
        "from them\n")
    assert (not os.path.exists(out)
            and len(eval_outputs.read_partial(ev.parse_args([*args, "--out", out]))) == 8)
    with pytest.raises(SystemExit):  # other settings would mix two evaluations in one result
        ev.parse_args([*args, "--out", out, "--max-turns", "5"])
    assert "holds a cut evaluation with --max-turns 4, not 5" in capsys.readouterr().err
    # memory only: free to change
    again = ev.main(ev.parse_args([*args, "--out", out, "--vllm-kv-tokens", "5000"]))
    assert ("continuing the cut evaluation" in capsys.readouterr().out
            and len(calls) == 4)  # one chunk left to play
    assert again["tasks"] == whole["tasks"] and again["statuses"] == whole["statuses"]

    def rows(folder):
        with open(tmp_path / folder / "r.rollouts.jsonl") as f:
            return [(t["item_id"], t["token_ids"], t["logprobs"]) for t in map(json.loads, f)]
    # the last chunk sampled from its own seed, as in the uncut run
    assert rows("cut") == rows("whole")
    assert not os.path.exists(eval_outputs.partial_path(out))


def test_an_out_without_a_folder_part_is_written_in_the_working_folder(tmp_path, corridor_url,
                                                                        monkeypatch):
    """`--out x.json` (and the default without --checkpoint) once played every episode, then
    failed making the folder "" of x.rollouts.jsonl."""
    monkeypatch.chdir(tmp_path)
    args = ["--env", "corridor", "--env-addr", corridor_url, "--limit", "2", "--n", "1",
            "--max-turns", "2", "--max-new-tokens", "4", "--threads", "1",
            "--cache-dir", str(tmp_path / "cache")]
    assert ev.parse_args(args).out == "eval_corridor_test.json"  # the default: no folder part
    res = ev.main(ev.parse_args([*args, "--out", "x.json"]))
    assert res["n_scored"] == 1
    assert sorted(os.listdir(tmp_path)) == ["cache", "x.json", "x.rollouts.jsonl"]


def test_a_game_registered_in_ones_own_script_is_evaluated(tmp_path):
    """docs/extending.md's MyGame, as written, registered in a script that then calls eval.main:
    served on a thread of that process (a `python -m env_server` child would not know the game,
    and the evaluation died in a 25-line traceback)."""
    from test_extending import doc_block

    script = tmp_path / "mygame_eval.py"
    script.write_text(doc_block("extending.md", "class MyGame") +
                      "\nimport sys\nimport eval\neval.main(eval.parse_args(sys.argv[1:]))\n")
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(script), "--env", "mygame", "--n", "2",
                        "--max-turns", "3", "--max-new-tokens", "4", "--threads", "1",
                        "--cache-dir", str(tmp_path / "cache"), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--env mygame is registered by this script" in r.stderr and "Traceback" not in r.stderr
    res = json.load(open(out))
    assert [t["item_id"] for t in res["tasks"]] == [3] and res["overall"]["samples"] == 2
    assert res["statuses"]["env_error"] == 0


def test_a_dialogue_past_the_request_budget_ends_as_context_limit(tmp_path, corridor_url):
    """An endpoint whose replies hold 90 KB (no move: the episode goes on): the dialogue sent each
    turn grows by as much (once, 6 turns of 8 MB replies made requests of 42 MB). Past
    --endpoint-max-context-kb 300 the request is not sent; the episode ends as context_limit,
    scored as it stands."""
    app, sizes = Flask("fake_chat_verbose"), []

    @app.post("/v1/chat/completions")
    def chat():
        from flask import request
        sizes.append(len(request.get_data()))
        return jsonify({"choices": [{"message": {"role": "assistant", "content": "x" * 90_000}}]})

    url, stop = serve_wsgi_in_thread(app)
    try:
        res = ev.main(ev.parse_args(["--env", "corridor", "--env-addr", corridor_url,
                                     "--endpoint", url + "/v1", "--endpoint-model", "fake",
                                     "--limit", "2", "--n", "1", "--max-turns", "10",
                                     "--endpoint-max-context-kb", "300",
                                     "--out", str(tmp_path / "ep.json")]))
    finally:
        stop()
    assert res["statuses"]["context_limit"] == 2 and res["overall"]["samples"] == 2, res
    # requests of about 1, 91, 181 and 271 KB were sent; the fifth, 361 KB, was not
    assert len(sizes) == 8 and max(sizes) <= 300 * 1024, sizes
    with open(tmp_path / "ep.rollouts.jsonl") as f:
        assert [json.loads(x)["turns"] for x in f] == [4, 4]


def test_a_result_is_not_replaced_without_a_word(tmp_path, corridor_url, capsys):
    """eval.py again into an --out that holds a result (an earlier --compare may read it) is
    refused in one line naming its settings, before anything plays; --overwrite replaces it."""
    out = str(tmp_path / "r.json")
    common = ["--env", "corridor", "--env-addr", corridor_url, "--random", "--max-turns", "3",
              "--limit", "2", "--out", out]
    ev.main(ev.parse_args([*common, "--n", "2"]))
    before = open(out).read()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.parse_args([*common, "--n", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"--out {out} already holds a result (random, n 2, --max-turns 3)" in err
    assert "--overwrite" in err and open(out).read() == before
    res = ev.main(ev.parse_args([*common, "--n", "4", "--overwrite"]))
    assert res["n"] == 4 and json.load(open(out))["n"] == 4
