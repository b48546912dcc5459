"""A training run and an evaluation against a hostile env server finish: answers that are nested
100,000 deep, 10 MB long, HTML, or a redirect are those trajectories' env errors (out of the loss,
counted), a lone surrogate in an observation is text the tokenizer takes, and the run writes its
checkpoint. (A trickled answer past --env-timeout is tests/test_env_client.py's.)"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

import train
from env_server.app import create_app, serve_wsgi_in_thread
from env_server.corridor import CorridorEnv

# instance id % 16 -> what its /step answers
HOSTILE = {1: "nested", 2: "huge", 3: "html", 4: "redirect", 5: "surrogate"}
ERRORS = {"nested", "huge", "html", "redirect"}  # the surrogate is text, once cleaned


def hostile(app):
    """WSGI middleware over a Corridor server: the health check offers no /batch (so that each
    instance's /step is its own request), and the /step of some instances answers badly."""
    def wrapped(environ, start_response):
        path = environ.get("PATH_INFO")
        if path == "/":
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b'{"ok": true}']
        if path != "/step":
            return app(environ, start_response)
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        mode = HOSTILE.get(int(json.loads(body)["id"]) % 16)
        environ["wsgi.input"] = __import__("io").BytesIO(body)
        if mode is None:
            return app(environ, start_response)
        json_type = [("Content-Type", "application/json")]
        if mode == "nested":
            start_response("200 OK", json_type)
            return [b"[" * 100_000]
        if mode == "huge":
            start_response("200 OK", json_type)
            obs = "x" * (10 * 2**20)
            return [json.dumps({"observation": obs, "reward": 0, "done": False}).encode()]
        if mode == "html":
            start_response("200 OK", [("Content-Type", "text/html")])
            return [b"<html><body>502 Bad Gateway</body></html>"]
        if mode == "redirect":
            start_response("302 Found", [("Location", "http://127.0.0.1:9/elsewhere")])
            return [b""]
        start_response("200 OK", json_type)  # a lone surrogate, as JSON carries it
        return [b'{"observation": "you see \\ud800 a wall", "reward": 0, "done": false}']
    return wrapped


@pytest.fixture
def hostile_url():
    url, stop = serve_wsgi_in_thread(hostile(create_app(CorridorEnv, first_id=0)))
    yield url
    stop()


def test_a_run_against_a_hostile_server_finishes_and_counts_env_errors(tmp_path, hostile_url):
    out = tmp_path / "run"
    cfg = train.parse_args(["--env", "corridor", "--env-addr", hostile_url, "--steps", "2",
                            "--schedule", "3", "--batch-size", "4", "--group-size", "4",
                            "--max-new-tokens", "4", "--eval-every", "0", "--threads", "1",
                            "--env-timeout", "20", "--out", str(out),
                            "--cache-dir", str(tmp_path / "cache")])
    train.main(cfg)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["status_env_error"] >= len(ERRORS) for r in rows), rows
    assert all(r["status_env_error"] <= 8 for r in rows)  # the hostile ones only
    assert (out / "checkpoint" / "model").is_dir()
    trajs = [json.loads(x) for x in open(out / "rollouts" / "step_000001.jsonl")]
    errors = " ".join(t["error"] or "" for t in trajs)
    for what in ("nested too deep", "answer over", "not JSON", "[http 302]"):
        assert what in errors, (what, errors[:2000])
    seen = [m["content"] for t in trajs for m in t["messages"] if "a wall" in m["content"]]
    assert seen and all("\ud800" not in x and "you see ? a wall" in x for x in seen)


def test_an_evaluation_against_a_hostile_server_finishes(tmp_path, hostile_url):
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "eval.py", "--env", "corridor", "--env-addr", hostile_url,
                        "--limit", "8", "--n", "2", "--max-turns", "3", "--max-new-tokens", "4",
                        "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    assert res["statuses"]["env_error"] >= 1 and res["n_scored"] >= 1
    assert os.path.exists(str(out).replace(".json", ".rollouts.jsonl"))
