"""SearchQA: answer scoring, observations in upstream's form, BM25 retrieval and its on-disk cache,
the remote retriever against a stub, the question loader, bad flags, the expert in-process and over
HTTP."""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, play_expert, raw
from flask import Flask, jsonify, request

from env_client import EnvClient
from env_server import searchqa_data
from env_server.app import ServerProcess, serve_wsgi_in_thread
from env_server.base import TaskError
from env_server.searchqa import (CORPUS_PATH, CORRECT, INVALID, PROMPT, QA_PATH, WRONG, BM25Index,
                                 Passage, RemoteRetriever, RetrievalError, SearchQAEnv, exact_match,
                                 format_passages, normalize_answer, read_questions)


def world_with(**flags):
    """A world from these flags (the rest at their defaults), as `python -m env_server searchqa`
    builds it."""
    defaults = {"corpus": None, "qa": None, "retriever_url": None, "index_dir": None, "topk": 3,
                "max_steps": 30}
    return SearchQAEnv.load_world(argparse.Namespace(**{**defaults, **flags}))


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bm25"))


@pytest.fixture(scope="module")
def world(index_dir):
    return world_with(index_dir=index_dir)


def start(world, idx):
    env = SearchQAEnv(world)
    return env, env.reset(idx)


def find(world, source, hops=None):
    """The id of the first question of `source` (with `hops` hops)."""
    return next(i for i, q in enumerate(world.questions)
                if q.source == source and (hops is None or len(q.hops) == hops))


# ---- the shipped data ----
def test_shipped_data_is_the_generators_output(tmp_path):
    searchqa_data.main(["--out", str(tmp_path)])
    for name, shipped in [(searchqa_data.CORPUS_FILE, CORPUS_PATH),
                          (searchqa_data.QA_FILE, QA_PATH)]:
        with open(tmp_path / name, "rb") as a, open(shipped, "rb") as b:
            assert a.read() == b.read(), (
                f"{shipped} is stale: run python -m env_server.searchqa_data")
        assert os.path.getsize(shipped) < 200_000
    docs = [json.loads(x) for x in open(CORPUS_PATH)]
    rows = [json.loads(x) for x in open(QA_PATH)]
    assert len(docs) == 288 and len({d["title"] for d in docs}) == len(docs)
    assert ({r["data_source"] for r in rows} == {"synthetic_1hop", "synthetic_2hop"}
            and len(rows) == 360)
    assert len({r["question"] for r in rows}) == len(rows)
    assert all(len(r["hops"]) == (1 if r["data_source"] == "synthetic_1hop" else 2) for r in rows)
    # the answer is on the last hop's page; a two-hop question's first page names the bridge
    text = {d["id"]: d["text"] for d in docs}
    title = {d["id"]: d["title"] for d in docs}
    for r in rows:
        assert r["golden_answers"][0] in text[r["hops"][-1]["doc"]], r
        if len(r["hops"]) == 2:
            assert title[r["hops"][1]["doc"]] in text[r["hops"][0]["doc"]], r


def test_splits_and_categories(world):
    splits = SearchQAEnv.splits(world)
    assert sorted(splits["train"] + splits["test"]) == list(range(360))
    assert len(splits["test"]) == 72  # every 5th question of each source
    for source in ("synthetic_1hop", "synthetic_2hop"):
        ids = [i for i in range(360) if SearchQAEnv.task_category(world, i) == source]
        assert [i for i in ids if i in splits["test"]] == ids[::5]


# ---- answers ----
def test_normalised_exact_match():
    assert normalize_answer("  The  Essel-River! ") == "esselriver"
    assert normalize_answer("An Apple, a Day") == "apple day"
    assert exact_match("the velmora", ["Velmora"]) and exact_match("VELMORA.", ["Velmora"])
    assert (exact_match("Essel", ["Essel River", "Essel"])
            and exact_match("essel river", ["Essel River", "Essel"]))
    assert exact_match("O. Vantrask", ["Oriel Vantrask", "O. Vantrask"])
    assert not exact_match("Velmora town", ["Velmora"]) and not exact_match("", ["Velmora"])
    assert not exact_match("Theodore", ["Odore"])  # articles go only as whole words
    assert exact_match("1871", ["1871"]) and not exact_match("1871.5", ["1871"])


def test_answers_right_wrong_and_any_gold(world):
    idx = next(i for i, q in enumerate(world.questions)
               if q.source == "synthetic_2hop" and len(q.answers) > 1)
    q = world.questions[idx]
    env, _ = start(world, idx)
    r = env.step("<answer>Nowhere In Particular</answer>")
    assert (r.observation, r.reward, r.done) == (WRONG, 0.0, False)
    # the alias, shouted, with an article
    r = env.step(f"<answer> the {q.answers[1].upper()}! </answer>")
    assert (r.observation, r.reward, r.done) == (CORRECT, 1.0, True)
    assert (env.detail()["reward"] == 1.0 and env.detail()["steps"] == 2
            and env.expert_action() is None)
    with pytest.raises(TaskError) as e:
        env.step("<answer>again</answer>")
    assert e.value.status == 409


# ---- observations ----
def test_first_observation_and_search_observation(world):
    idx = find(world, "synthetic_2hop")
    q = world.questions[idx]
    env, first = start(world, idx)
    assert (first == PROMPT.format(question=q.question)
            and first.endswith(f"\n\nQuestion: {q.question}"))
    assert first.startswith("Think inside <think>...</think>")
    assert env.observation() == first
    r = env.step(f"<search> {q.hops[0].query} </search>")
    assert (r.reward, r.done) == (0.0, False)
    assert (r.observation.startswith('<information>Doc 1(Title: "')
            and r.observation.endswith("</information>"))
    lines = r.observation[len("<information>"):-len("</information>")].split("\n")
    assert [ln[:len("Doc 1(Title: ")] for ln in lines] == [f"Doc {i}(Title: " for i in (1, 2, 3)]
    assert env.observation() == r.observation and env.detail()["searches"] == [q.hops[0].query]


def test_format_passages_is_search_r1s():
    docs = [Passage("1", '"Zorvex Labs"\nZorvex Labs is a company.', 2.0),
            Passage("2", "Plain\nline one\nline two", 1.0)]
    assert format_passages(docs) == ('Doc 1(Title: "Zorvex Labs") Zorvex Labs is a company.\n'
                                     "Doc 2(Title: Plain) line one\nline two\n")


def test_invalid_actions_and_no_match(world):
    env, _ = start(world, 0)
    for action in ["dance", "Action: search Velmora", "<search>Velmora", "<search>x</answer>", ""]:
        r = env.step(action)
        assert (r.observation, r.reward, r.done) == (INVALID, 0.0, False), action
    # the first block counts, as the client sends it; words found nowhere return no passages
    assert (env.step("<search>qqqqzz xxyyzz</search><answer>x</answer>").observation
            == "<information></information>")
    assert env.step("<search></search>").observation == "<information></information>"
    assert env.available_actions() == ["<search>query</search>", "<answer>answer</answer>"]


def test_step_limit_ends_the_episode(world):
    env, _ = start(world, 0)
    env.world = dataclasses.replace(world, max_steps=3)
    assert not env.step("dance").done and not env.step("<answer>no</answer>").done
    r = env.step("<search>Velmora</search>")
    assert r.done and r.reward == 0.0 and r.info == {"truncated": True}
    env.reset(0)  # a finished instance can start again
    assert (env.detail()["done"] is False and env.detail()["steps"] == 0
            and env.detail()["searches"] == [])


def test_caller_mistakes_are_task_errors(world):
    env = SearchQAEnv(world)
    for call, status in [(lambda: env.step("<search>x</search>"), 409), (env.observation, 409),
                         (lambda: env.reset(360), 404), (lambda: env.reset(-1), 404),
                         (lambda: env.reset("3"), 400),
                         (lambda: env.reset(True), 400)]:
        with pytest.raises(TaskError) as e:
            call()
        assert e.value.status == status
    assert env.detail() == {"task_id": None, "done": False} and env.expert_action() is None
    env.reset(0)
    with pytest.raises(TaskError, match="must be a string"):
        env.step(["<search>x</search>"])


# ---- retrieval ----
def test_expert_searches_find_the_gold_page(world):
    hops = [(q.source, h) for q in world.questions for h in q.hops]
    t0 = time.perf_counter()
    hits = {src: [h.doc in {p.doc_id for p in world.retriever.search(h.query, 3)}
                  for s, h in hops if s == src]
            for src in ("synthetic_1hop", "synthetic_2hop")}
    ms = (time.perf_counter() - t0) / len(hops) * 1e3
    rates = {s: sum(v) / len(v) for s, v in hits.items()}
    print(f"\ngold page in the top 3: {rates}; {ms:.3f} ms per search over {len(hops)} searches")
    assert min(rates.values()) >= 0.95
    # look-alikes compete: the right page is not always alone near the top
    top1 = [world.retriever.search(h.query, 1)[0].doc_id == h.doc for _, h in hops]
    assert 0.9 < sum(top1) / len(top1)


def test_bm25_index_builds_fast_and_is_cached(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(CORPUS_PATH, corpus)
    cache = str(tmp_path / "cache")
    first = BM25Index(str(corpus), cache)
    print(f"\nBM25 index of {len(first.ids)} passages built in {first.load_s:.3f} s")
    assert first.built and first.load_s < 10.0
    second = BM25Index(str(corpus), cache)
    assert not second.built and second.path == first.path
    q = "Zorvex Labs founder"
    assert second.search(q, 3) == first.search(q, 3)
    os.utime(corpus, ns=(1, 1))  # an edited file gets its own index
    third = BM25Index(str(corpus), cache)
    assert third.built and third.path != first.path
    # a damaged cache is rebuilt, not trusted
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "extra", "title": "Extra", "text": "one more"}) + "\n")
    os.utime(corpus, ns=(1, 1))  # same mtime and path, but the size differs: a new key anyway
    assert BM25Index(str(corpus), cache).built


# ---- the remote retriever ----
@pytest.fixture(scope="module")
def stub_retriever(world):
    """A Search-R1-style /retrieve server answering from the local index; records the requests."""
    app, seen = Flask("stub_retriever"), []

    @app.post("/retrieve")
    def retrieve():
        body = request.get_json()
        seen.append(body)
        if body["queries"] == ["fail"]:
            return "boom", 500
        if body["queries"] == ["garbage"]:
            return jsonify({"no": "result"})
        results = [[{"document": {"id": p.doc_id, "contents": p.contents}, "score": p.score}
                    for p in world.retriever.search(q, body["topk"])] for q in body["queries"]]
        return jsonify({"result": results})

    url, stop = serve_wsgi_in_thread(app)
    yield url + "/retrieve", seen
    stop()


def test_remote_retriever_speaks_search_r1s_api(world, stub_retriever):
    url, seen = stub_retriever
    remote = world_with(retriever_url=url)
    assert isinstance(remote.retriever, RemoteRetriever)
    idx = find(world, "synthetic_2hop")
    local_env, _ = start(world, idx)
    env, _ = start(remote, idx)
    for _ in range(3):  # the expert plays the same game through either retriever
        a = env.expert_action()
        assert a == local_env.expert_action()
        r, r_local = env.step(a), local_env.step(a)
        assert ((r.observation, r.reward, r.done)
                == (r_local.observation, r_local.reward, r_local.done))
    assert r.done and r.reward == 1.0
    assert seen[0] == {"queries": [world.questions[idx].hops[0].query], "topk": 3,
                       "return_scores": True}
    with pytest.raises(RetrievalError, match="HTTP 500"):
        remote.retriever.search("fail", 3)
    with pytest.raises(RetrievalError, match="unreadable"):
        remote.retriever.search("garbage", 3)
    dead = RemoteRetriever("http://127.0.0.1:9/retrieve", timeout_s=2, retries=1)
    with pytest.raises(RetrievalError, match="unreachable after 2 tries"):
        dead.search("x", 3)


# ---- loading: question files, corpus formats, bad flags ----
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_question_files_split_rule_and_prefixes(tmp_path):
    rows = [{"question": f"q{i}?", "golden_answers": [f"a{i}"],
             "data_source": "nq" if i % 2 else "hotpotqa"}
            for i in range(20)]
    plain = write_jsonl(tmp_path / "mixed.jsonl", rows)
    questions, splits = read_questions([plain])
    assert [q.question for q in questions] == [r["question"] for r in rows]  # file order
    # rows 0, 5 of each source
    assert splits["test"] == [0, 1, 10, 11] and len(splits["train"]) == 16
    test = write_jsonl(tmp_path / "test.jsonl", [{"question": "t?", "golden_answers": ["x"]}])
    questions, splits = read_questions([f"test={test}", f"train={plain}"])
    assert splits == {"test": [0], "train": list(range(1, 21))}
    # defaults: file stem, place
    assert questions[0].source == "test" and questions[0].qid == "test.jsonl:1"
    # no route in the data: search the question
    assert [h.query for h in questions[0].hops] == ["t?"]


def test_user_files_and_expert_without_hops(tmp_path, index_dir):
    corpus = write_jsonl(tmp_path / "wiki.jsonl", [  # Search-R1's own corpus format
        {"id": "0", "contents": '"Velmora"\nVelmora is a town on the Essel River.'},
        {"id": "1", "contents": '"Quenbury"\nQuenbury is a town on the Tarn River.'}])
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"id": "x1",
                                              "question": "Which river flows through Velmora",
                                              "golden_answers": ["Essel River", "Essel"],
                                              "data_source": "toy"}])
    w = world_with(corpus=corpus, qa=[qa], index_dir=index_dir, topk=1)
    env, first = start(w, 0)
    assert first.endswith("Question: Which river flows through Velmora")
    r = env.step(env.expert_action())
    assert r.observation == ('<information>Doc 1(Title: "Velmora") Velmora is a town on the '
                             'Essel River.</information>')
    assert (env.expert_action() == "<answer>Essel River</answer>"
            and env.step("<answer>essel</answer>").done)
    assert SearchQAEnv.task_category(w, 0) == "toy" and env.detail()["qid"] == "x1"


def test_bad_flags_and_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--corpus: no such file: /no/such/corpus.jsonl"):
        world_with(corpus="/no/such/corpus.jsonl")
    with pytest.raises(FileNotFoundError, match="--qa: no such file: /no/such/qa.jsonl"):
        world_with(qa=["/no/such/qa.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "golden_answers": ["a"]}\n'
                   '{"question": "q2?", "golden_answers": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'golden_answers' must be a non-empty list"):
        world_with(qa=[str(bad)])
    bad.write_text('{"id": 1, "title": "T"}\n')
    with pytest.raises(ValueError, match=r"--corpus .*bad.jsonl:1: need"):
        world_with(corpus=str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"--qa .*bad.jsonl:1"):
        world_with(qa=[str(bad)])
    with pytest.raises(ValueError, match="--topk must be at least 1"):
        world_with(topk=0)
    with pytest.raises(ValueError, match="exclude each other"):
        world_with(corpus=CORPUS_PATH, retriever_url="http://127.0.0.1:8000/retrieve")
    with pytest.raises(ValueError, match="--retriever-url must be an http"):
        world_with(retriever_url="localhost:8000")
    out = subprocess.run([sys.executable, "-m", "env_server", "searchqa",
                          "--qa", "/no/such/qa.jsonl"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "--qa: no such file: /no/such/qa.jsonl" in out.stderr


# ---- the expert ----
def test_expert_answers_every_question_in_process(world):
    env = SearchQAEnv(world)
    results = [play_expert(env, i, 4) for i in range(len(world.questions))]
    assert all(v == 1.0 for v, _ in results)
    assert max(t for _, t in results) <= 3  # a search per hop, then the answer


def test_expert_recovers_after_detours(world):
    idx = find(world, "synthetic_2hop")
    env, _ = start(world, idx)
    for action in ["<search>Velmora</search>", "<answer>wrong</answer>", "dance"]:
        env.step(action)
    for _ in range(3):
        r = env.step(env.expert_action())
    assert r.done and r.reward == 1.0


@pytest.fixture(scope="module")
def server(index_dir):
    with ServerProcess("searchqa", "--index-dir", index_dir) as s:
        yield s


def test_over_http_the_expert_scores_one(server, world):
    status, t = raw(server.url, "GET", "/tasks")
    assert status == 200 and t["num_tasks"] == 360 and t["splits"] == SearchQAEnv.splits(world)
    sample = t["splits"]["test"][::3] + t["splits"]["train"][::12]
    results = []

    def worker(ids):
        c = EnvClient(server.url)
        results.extend(play_expert(c, i, 4) for i in ids)
        c.close()

    threads = [threading.Thread(target=worker, args=(sample[k::4],)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == len(sample) and all(v == 1.0 for v, _ in results)


def test_over_http_errors_and_details(server):
    c = EnvClient(server.url)
    first = c.reset(200)
    assert "Question: " in first and c.observation() == first
    d = c.detail()
    assert (d["task"] == 200 and d["category"] == "synthetic_2hop" and d["steps"] == 0
            and d["done"] is False)
    assert c.available_actions() == ["<search>query</search>", "<answer>answer</answer>"]
    s = c.step("<answer>surely not</answer>")
    assert (s.observation, s.reward, s.done) == (WRONG, 0.0, False)
    iid = c.id
    assert c.id_key == "env_idx"  # the client's create carries AgentGym's `id`: a bare id came back
    assert raw(server.url, "POST", "/step", {"id": iid, "action": 5})[0] == 400
    assert raw(server.url, "POST", "/reset", {"id": iid, "data_idx": 360})[0] == 400
    # AgentGym's dialect: bare
    status, obs = raw(server.url, "POST", "/reset", {"env_idx": iid, "id": 3})
    assert status == 200 and isinstance(obs, str) and "Question: " in obs
    # the project's: an object
    status, r = raw(server.url, "POST", "/reset", {"id": iid, "data_idx": 3})
    assert status == 200 and r["observation"] == obs
    for path, body, code in [("/create", {"id": 360}, 400), ("/create", {"id": "3"}, 400),
                             ("/reset", {"env_idx": iid}, 400),
                             ("/reset", {"env_idx": iid, "id": 360}, 400),
                             ("/reset", {"env_idx": 10**12, "id": 3}, 404),
                             ("/step", {"env_idx": iid}, 400)]:
        status, e = raw(server.url, "POST", path, body)
        assert status == code and "error" in e, (path, body, status, e)
    c.close()
