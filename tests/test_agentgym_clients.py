"""AgentGym's own env clients drive this project's servers. Each client here is rebuilt from what is
known of the requests AgentGym's client sends and what it reads back (not from its code):

- TextCraft: JSON everywhere; `/create` answers an object whose `id` it keeps.
- BabyAI, SciWorld: `/create` is a POST with no body and no Content-Type; `id` from the object.
- SciWorld: its first observation is `/reset`'s `task_description`, a newline, then its
  `observation` (a KeyError where either is missing); later ones are the steps' `observation`s.
- SearchQA: `/create` sends {"id": 0} and reads a bare integer back, kept as `env_idx`; `/reset`
  sends {"env_idx": ..., "id": <task index>} and reads the bare observation;
  `/observation?env_idx=` reads a bare string; `/step` sends {"env_idx", "action"} and reads
  {"observation", "reward", "done", "info"}; `/close` sends {"env_idx"}.

Then create, reset, step, observation and close, against a real server of each game."""

import http.client
import importlib.util
import json
import shutil
from urllib.parse import urlsplit

import pytest

from env_server.app import ServerProcess, serve_in_thread
from env_server.babyai import BabyAIEnv
from env_server.textcraft import TextCraftEnv


def call(url: str, method: str, path: str, body=None, content_type: bool = True):
    """One request as the client sends it: a JSON body, or (body None) no body and no
    Content-Type."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json"} if body is not None and content_type else {}
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, (method, path, resp.status, data[:300])
    return json.loads(data)


class IdClient:
    """TextCraft's (JSON create), BabyAI's and SciWorld's (body-less create) clients: `id`
    throughout."""

    def __init__(self, url: str, json_create: bool):
        self.url = url
        created = call(url, "POST", "/create", {} if json_create else None)
        self.env_id = created["id"]

    def reset(self, idx: int):
        return call(self.url, "POST", "/reset", {"id": self.env_id, "data_idx": idx})

    def step(self, action: str):
        return call(self.url, "POST", "/step", {"id": self.env_id, "action": action})

    def observe(self) -> str:
        return call(self.url, "GET", f"/observation?id={self.env_id}")

    def close(self):
        return call(self.url, "POST", "/close", {"id": self.env_id})


class SciWorldClient(IdClient):
    """AgentGym's SciWorld client: keeps the observation itself, from reset's and each step's."""

    def __init__(self, url: str):
        super().__init__(url, json_create=False)

    def reset(self, idx: int):
        r = super().reset(idx)
        self.info = r["task_description"] + "\n" + r["observation"]
        return r

    def step(self, action: str):
        r = super().step(action)
        self.info = r["observation"]
        assert isinstance(r["score"], int)  # the step's reward to that client
        return r

    def observe(self) -> str:
        return self.info


class SearchQAClient:
    """AgentGym's SearchQA client: a bare id from `/create {"id": 0}`, kept as env_idx; each answer
    is checked for the type that client reads."""

    def __init__(self, url: str):
        self.url = url
        self.env_idx = call(url, "POST", "/create", {"id": 0})
        assert type(self.env_idx) is int

    def reset(self, idx: int):
        obs = call(self.url, "POST", "/reset", {"env_idx": self.env_idx, "id": idx})
        assert isinstance(obs, str) and obs
        return obs

    def step(self, action: str):
        out = call(self.url, "POST", "/step", {"env_idx": self.env_idx, "action": action})
        assert isinstance(out, dict) and set(out) >= {"observation", "reward", "done", "info"}
        return out

    def observe(self) -> str:
        obs = call(self.url, "GET", f"/observation?env_idx={self.env_idx}")
        assert isinstance(obs, str)
        return obs

    def close(self):
        return call(self.url, "POST", "/close", {"env_idx": self.env_idx})


def play(client, task: int, action: str) -> dict:
    client.reset(task)
    first = client.observe()
    assert isinstance(first, str) and first
    step = client.step(action)
    assert isinstance(step["observation"], str) and isinstance(step["done"], bool)
    assert isinstance(step["reward"], (int, float))
    assert isinstance(client.observe(), str)
    assert client.close() is True
    return {"first": first, "step": step}


@pytest.fixture
def threaded():
    stops = []

    def start(env_cls):
        url, stop = serve_in_thread(env_cls)
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


def test_textcraft_client(threaded):
    url = threaded(TextCraftEnv)
    got = play(IdClient(url, json_create=True), 0, "inventory")
    assert "Crafting commands" in got["first"] or "Goal" in got["first"]


def test_babyai_client(threaded):
    url = threaded(BabyAIEnv)
    play(IdClient(url, json_create=False), 0, "turn left")


@pytest.mark.skipif(importlib.util.find_spec("scienceworld") is None
                    or shutil.which("java") is None,
                    reason="ScienceWorld cannot run here "
                           "(the scienceworld package or java is missing)")
def test_sciworld_client():
    with ServerProcess("sciworld", "--max-jvms", "2") as server:
        got = play(SciWorldClient(server.url), 0, "look around")
    task, view = got["first"].split("\n", 1)
    assert task.startswith("Your task is to boil ") and view.startswith("This room is called the ")
    assert got["first"].count(task) == 1 and got["step"]["observation"].startswith("This room is")


def test_searchqa_client(tmp_path):
    with ServerProcess("searchqa", "--index-dir", str(tmp_path)) as server:
        client = SearchQAClient(server.url)
        first = client.observe()  # AgentGym's create starts the instance on task `id`
        assert client.reset(4) == client.observe() != first
        got = play(client, 3, "<search>capital</search>")
        assert "Question" in got["first"] or "question" in got["first"]
        # a body-less create (older SearchQA clients) is answered a bare id too
        assert type(call(server.url, "POST", "/create")) is int
        # the project's own dialect on the same server: objects from a create without `id` and a
        # reset by `id`
        created = call(server.url, "POST", "/create", {"request_key": "k"})
        assert isinstance(created, dict) and type(created["id"]) is int
        reset = call(server.url, "POST", "/reset", {"id": created["id"], "data_idx": 3})
        assert reset["observation"] == got["first"] and reset["done"] is False


def test_a_bodyless_post_still_needs_a_loopback_host_and_no_foreign_origin(threaded):
    url = threaded(BabyAIEnv)
    u = urlsplit(url)
    for headers, status in (({"Origin": "http://evil.example"}, 403),
                            ({"Host": "evil.example"}, 403),
                            ({"Content-Type": "text/plain"}, 200), ({}, 200)):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/create", None, headers)
        resp = conn.getresponse()
        resp.read()
        conn.close()
        assert resp.status == status, headers
    # a body that is not JSON: still 415
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/create", "{}", {"Content-Type": "text/plain"})
    resp = conn.getresponse()
    assert resp.status == 415 and "error" in json.loads(resp.read())
    conn.close()
