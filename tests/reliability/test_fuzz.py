"""Property-based fuzzing (hypothesis) of every endpoint of the env servers, on every CPU env.

Whatever a client sends (random JSON, the right field names with wrong-typed values, huge and
unicode strings with lone surrogates, negative and huge ids, broken bytes, deep nesting, random
query strings, random /batch op lists, odd action text on a live episode, malformed HTTP),
the server:
- never answers a 5xx (SciWorld's "all JVMs in use" 503 aside: a full server, said plainly);
- answers every 4xx with a JSON object that has an "error";
- keeps serving: afterwards GET / answers and a normal create -> reset -> step -> close episode
  works.

Most examples go through Flask's test client (fast, same app); test_malformed_http talks to a real
waitress server over raw sockets. Every run is seeded (derandomize=True): CI replays the same
examples. FUZZ_EXAMPLES=N runs N examples per test (SciWorld: N/10) to hunt bugs locally. A case the
fuzzer found stays as an @example, each naming the bug it caught.
"""

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import time
from urllib.parse import quote, urlsplit

import pytest
from conftest import raw
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from toy_env import CounterEnv

from env_server.app import create_app, serve_in_thread
from env_server.babyai import BabyAIEnv
from env_server.base import StepResult
from env_server.corridor import CorridorEnv
from env_server.sciworld import SciWorldEnv
from env_server.searchqa import SearchQAEnv, first_tag
from env_server.textcraft import TextCraftEnv


BIG_RUN = os.environ.get("FUZZ_EXAMPLES")  # examples per test for a local bug hunt


def fuzz(examples: int, jvm: bool = False):
    """Settings of one fuzz run: seeded, so CI replays the same `examples`. FUZZ_EXAMPLES=N
    overrides the count (a tenth of N where examples start JVMs)."""
    if BIG_RUN:
        examples = max(1, int(BIG_RUN) // (10 if jvm else 1))
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class SafeCounterEnv(CounterEnv):
    """The toy game without its deliberate traps, which test_env_server.py and test_faults.py check
    on purpose: "crash" (a 500) and "sleep N" (a hung game)."""

    def step(self, action):
        if action == "crash" or action.startswith("sleep "):
            return StepResult("trap disabled", 0.0, False)
        return super().step(action)


ENVS = {"counter": SafeCounterEnv, "corridor": CorridorEnv, "textcraft": TextCraftEnv,
        "babyai": BabyAIEnv, "searchqa": SearchQAEnv}
POST_PATHS = ["/create", "/reset", "/step", "/close", "/batch"]
GET_PATHS = ["/observation", "/available_actions", "/detail", "/expert_action"]
LIVE_IDS = range(-3, 7)  # instance ids the fuzz hits often: the app's first ids are 0, 1, 2, ...


@functools.cache
def world(name: str):
    return ENVS[name].load_world(None)


def new_app(env_cls, world, **kw):
    """An app whose instance ids start at 0, so that small fuzzed ids hit live instances; with no
    reaper and room for every instance the fuzz creates."""
    return create_app(env_cls, world, first_id=0, idle_timeout_s=0,
                      **{"max_instances": 100_000, **kw})


@pytest.fixture(params=list(ENVS))
def client(request):
    """A fresh app per test (so a test's examples do not depend on the tests run before it) with
    instance 0 created, 1 reset to task 0, and 2 reset and closed: the states a fuzzed id may
    find."""
    app = new_app(ENVS[request.param], world(request.param))
    c = app.test_client()
    for body in ({}, {"data_idx": 0}, {"data_idx": 0}):
        assert c.post("/create", json=body).status_code == 200
    assert c.post("/close", json={"id": 2}).status_code == 200
    yield c
    app.extensions["registry"].stop()


# ---------------------------------------------------------------- strategies
# every code point, lone surrogates (category Cs) too
any_char = st.characters(exclude_categories=[])
texts = st.text(any_char, max_size=20)
# Around the limits: 100,000 characters per action; 1 MiB per body, which 180,000 escaped characters
# pass.
huge_texts = st.builds(lambda s, n: (s * n)[:n], st.text(any_char, min_size=1, max_size=3),
                       st.sampled_from([5000, 99_999, 100_000, 100_001, 180_000]))
huge_ints = st.sampled_from([2**31, 2**63, -2**63 - 1, 2**64, -10**100,
                             10**4000])  # json reads <= 4300 digits
ids = st.one_of(st.sampled_from(LIVE_IDS), st.integers(), huge_ints)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), huge_ints,
                    st.floats(), texts)  # NaN, inf too
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)

# Words of every game's commands, so random actions sometimes do something in the game.
VOCAB = ["get", "craft", "using", "inventory", "1", "4", "0", "9" * 12, "oak log", "oak planks",
         "stick", "minecraft:stick", ",", "<search>", "</search>", "<answer>", "</answer>", "go to",
         "go through", "toggle and go through", "pickup", "pick up", "toggle", "drop", "turn left",
         "turn right", "move forward", "check available actions", "red ball 1", "grey key 1",
         "door 1", "left", "right", "add 2", "look around", "open door", "focus on", "the",
         "\n", "."]
actions = st.one_of(
    st.lists(st.one_of(st.sampled_from(VOCAB), texts), max_size=8).map(" ".join),
    texts,
    # Pathological repetitions, "<search>" * 12500 among them.
    st.builds(lambda w, n: w * n, st.sampled_from(["<search>", "<answer>x", "craft 1 a using ", "9",
                                                    "left ", "go to red ball 1 ", "\ud800",
                                                    "\x00"]),
              st.integers(1, 20_000)),
    huge_texts,
)

FIELDS = ["id", "env_idx", "data_idx", "idx", "action", "ops", "op", "seed"]
# right names, any values
payloads = st.dictionaries(st.sampled_from(FIELDS) | texts,
                           st.one_of(ids, actions, json_values), max_size=5)
bodies = st.one_of(payloads, json_values)

OPS = ["create", "reset", "step", "close"]
op_items = st.builds(lambda op, rest: {**rest, "op": op}, st.sampled_from(OPS) | json_values,
                     payloads)
batch_bodies = st.one_of(st.fixed_dictionaries({"ops": st.lists(op_items | json_values,
                                                                max_size=10)}),
                         st.fixed_dictionaries({"ops": json_values}), bodies)


def encode(obj, encoding: str = "utf-8") -> bytes:
    """JSON bytes as a careless client might send them; lone surrogates stay lone (invalid
    UTF-8)."""
    return json.dumps(obj, ensure_ascii=False).encode(encoding, "surrogatepass")


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda opener, n: opener * n,
              st.sampled_from([b"[", b'{"a":', b'[{"ops":[', b'{"id":', b"\xff"]),
              st.integers(1, 200_000)),
    st.builds(encode, payloads, st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-8-sig"])),
    # a valid body with junk bytes spliced in, or cut short
    st.builds(lambda b, i, junk: b[:i % (len(b) + 1)] + junk, payloads.map(encode),
              st.integers(0, 10**6), st.binary(max_size=4)),
)

query_values = st.one_of(ids.map(str), texts,
                         st.sampled_from(["", "9" * 5000, "1e3", " 1 ", "0x1", "\u0661", "1_0",
                                          "-0", "+1", "nan"]))
queries = st.one_of(
    st.lists(st.tuples(st.sampled_from(["id", "env_idx"]) | texts, query_values), max_size=3).map(
        lambda pairs: "&".join(f"{quote(k.encode('utf-8', 'surrogatepass'), safe='')}="
                               f"{quote(v.encode('utf-8', 'surrogatepass'), safe='')}"
                               for k, v in pairs)),
    st.binary(max_size=30).map(lambda b: quote(b, safe="=&%")),  # invalid UTF-8, broken %-escapes
)
paths = st.one_of(st.sampled_from(POST_PATHS + GET_PATHS + ["/", "/tasks", "/nope", "/step/",
                                                            "//step", "/observation/1", "/%ff",
                                                            "/../tasks"]),
                  texts.map(lambda s: "/" + quote(s.encode("utf-8", "surrogatepass"))))
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE",
                           "FOO"])


# ---------------------------------------------------------------- the property
def tolerated(resp, status: int, error: str, capacity_ok: bool) -> bool:
    """The one 5xx this fuzz lets pass: SciWorld's JVM cap (where the test lets the fuzz create more
    instances than it has JVMs)."""
    return capacity_ok and status == 503 and "--max-jvms" in error


def check(resp, method: str = "GET", capacity_ok: bool = False) -> None:
    """Never a 5xx; a 4xx is a JSON object with an "error"; a /batch answer's ops obey the same
    rule."""
    data = resp.get_data()
    if tolerated(resp, resp.status_code, data.decode(), capacity_ok):
        return
    assert resp.status_code < 500, (resp.status_code, data[:500])
    if resp.status_code >= 400 and method != "HEAD":  # HEAD answers carry no body
        err = json.loads(data)
        assert isinstance(err, dict) and isinstance(err.get("error"), str), data[:500]
    if resp.status_code == 200 and method == "POST" and resp.request.path == "/batch":
        for r in json.loads(data)["results"]:
            if (isinstance(r, dict) and "status" in r
                    and not tolerated(resp, r["status"], r["error"], capacity_ok)):
                assert r["status"] < 500 and isinstance(r["error"], str), r


def post(client, path: str, body):
    """POST a JSON-able body, or exact bytes."""
    # NaN, Infinity and "\ud800" escapes
    data = body if isinstance(body, bytes) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json")


def via(client):
    """`call(method, path, body=None) -> (status, JSON)` through the test client, as conftest's
    raw() over HTTP."""
    def call(method: str, path: str, body=None):
        r = client.open(path, method=method, json=body)
        return r.status_code, r.get_json()
    return call


def assert_still_serving(call) -> None:
    """GET / answers, and one normal episode plays: create, reset, up to two steps (the expert's,
    when it has one), every read, close. `call` is via(client) or functools.partial(raw, url)."""
    status, health = call("GET", "/")
    assert status == 200 and health["status"] == "ok", health
    iid = call("POST", "/create", {})[1]["id"]
    status, r = call("POST", "/reset", {"id": iid, "data_idx": 0})
    assert status == 200 and isinstance(r["observation"], str), r
    for _ in range(2):
        action = call("GET", f"/expert_action?id={iid}")[1] or "inventory"
        status, r = call("POST", "/step", {"id": iid, "action": action})
        assert status == 200, r
        if r["done"]:
            break
    for path in GET_PATHS:
        assert call("GET", f"{path}?id={iid}")[0] == 200
    assert call("POST", "/close", {"id": iid}) == (200, True)


# ---------------------------------------------------------------- fuzz through the test client
def test_json_bodies(client):
    @fuzz(60)
    @given(path=st.sampled_from(POST_PATHS), body=bodies)
    @example(path="/step",
             body={"id": 1, "action": "get " + "9" * 5000 + " oak log"})  # textcraft: int() failed
    @example(path="/step",
             body={"id": 1, "action": "\ud800"})  # now a 400 for all (it killed SciWorld's JVM)
    @example(path="/step",
             body={"id": 1, "action": "<search>" * 12500})  # searchqa: 8 s of regex backtracking
    @example(path="/reset", body={"id": 10**4000, "data_idx": -(10**4000)})
    def run(path, body):
        check(post(client, path, body), "POST")

    run()
    assert_still_serving(via(client))


def test_raw_bodies(client):
    @fuzz(60)
    @given(path=st.sampled_from(POST_PATHS), body=raw_bodies)
    @example(path="/create", body=b"[" * 100_000)  # RecursionError in json.loads: was a 500
    @example(path="/step", body=b'{"id": 1, "action": ' * 20_000)
    @example(path="/reset", body=b'{"id": ' + b"9" * 5000 + b"}")  # past json's 4300-digit limit
    @example(path="/step",
             body=b'{"id": 1, "action": "\xed\xa0\x80"}')  # a surrogate coded in UTF-8
    @example(path="/batch", body=b"")
    def run(path, body):
        check(post(client, path, body), "POST")

    run()
    assert_still_serving(via(client))


def test_query_strings_methods_and_paths(client):
    @fuzz(80)
    @given(method=methods, path=paths, query=queries, body=st.one_of(st.just(b""), raw_bodies))
    @example(method="GET", path="/observation", query="id=0",
             body=b"")  # before reset: corridor's 500
    @example(method="GET", path="/detail", query="id=0", body=b"")
    @example(method="GET", path="/expert_action", query="env_idx=0", body=b"")
    @example(method="GET", path="/detail", query="id=" + "9" * 5000, body=b"")
    def run(method, path, query, body):
        check(client.open(f"{path}?{query}", method=method, data=body), method)

    run()
    assert_still_serving(via(client))


def test_batch(client):
    @fuzz(60)
    @given(body=batch_bodies)
    @example(body={"ops": [{"op": "step", "id": 1, "action": "\ud800"},
                           {"op": "reset", "id": 0, "data_idx": 0}, {"op": "close", "id": 0},
                           {"op": "step", "id": 0, "action": "x"}, 5, None]})
    def run(body):
        check(post(client, "/batch", body), "POST")

    run()
    assert_still_serving(via(client))


def test_live_episodes(client):
    """Valid create and reset, then random actions (now and then the expert's, to get deeper into
    the game) and reads on the live instance: where odd action text meets the game's own code."""
    num_tasks = client.get("/").get_json()["num_tasks"]
    expert = "<expert>"

    @fuzz(40)
    @given(task=st.integers(0, 10**6),
           moves=st.lists(st.one_of(actions, st.just(expert), st.sampled_from(GET_PATHS)),
                          max_size=10))
    @example(task=0, moves=["get 1 oak log", "craft 1 stick using 9999999999 oak planks",
                            "inventory"])  # 10 digits
    @example(task=0, moves=[expert, "<search>" * 12500, expert, "<answer>\udfff</answer>"])
    def run(task, moves):
        task %= num_tasks
        r = post(client, "/create", {"data_idx": task})
        check(r, "POST")
        iid = r.get_json()["id"]
        for move in moves:
            if move in GET_PATHS:
                check(client.get(f"{move}?id={iid}"))
                continue
            if move == expert:
                r = client.get(f"/expert_action?id={iid}")
                check(r)
                move = r.get_json()
                if move is None:
                    continue
            r = post(client, "/step", {"id": iid, "action": move})
            check(r, "POST")
            if r.status_code == 200 and r.get_json()["done"]:
                check(post(client, "/reset", {"id": iid, "data_idx": task}), "POST")
        check(post(client, "/close", {"id": iid}), "POST")

    run()
    assert_still_serving(via(client))


def test_host_origin_and_content_type():
    """The cross-site guard reads Host, Origin and Content-Type, which any client may fill with
    anything: whatever they hold, the answer is not a 5xx (a refusal is a JSON 403 or 415)."""
    app = new_app(SafeCounterEnv, world("counter"))
    client = app.test_client()
    header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                        exclude_characters="\x7f"),
                          max_size=30)
    hosts = st.sampled_from(["127.0.0.1", "localhost:1", "[::1]:80", "[::1", "a:b:c", "", ":", "@",
                             "evil.example@127.0.0.1", "\u00e9", "[fe80::1%eth0]"]) | header_text
    origins = (hosts.map(lambda h: "http://" + h)
               | st.sampled_from(["null", "http://[", "file://", ""]) | header_text)
    types = st.sampled_from(["application/json", "APPLICATION/JSON; charset=x", "application/json;",
                             "text/plain", "application/jsonx", ";", ""]) | header_text

    @fuzz(80)
    @given(method=st.sampled_from(["GET", "POST", "OPTIONS"]),
           path=st.sampled_from(["/", "/create", "/step"]),
           host=st.none() | hosts, origin=st.none() | origins, ctype=st.none() | types)
    def run(method, path, host, origin, ctype):
        headers = {k: v for k, v in (("Host", host), ("Origin", origin), ("Content-Type", ctype))
                   if v is not None}
        try:
            r = client.open(path, method=method, headers=headers, data=b"{}")
        except ValueError as e:
            # werkzeug's test client cannot build its own URL for a Host with a bad port (not the
            # app's doing: test_malformed_http sends such Hosts to a real server)
            assume("Port" not in str(e))
            raise
        check(r, method)
        if r.status_code in (403, 415):
            assert r.get_json()["error"]

    run()
    assert_still_serving(via(client))
    app.extensions["registry"].stop()


@pytest.mark.parametrize("body", [{"ops": []}, {"ops": [{"op": []}, {"op": {}}]}])
def test_empty_and_odd_batches(body):
    r = post(new_app(SafeCounterEnv, world("counter")).test_client(), "/batch", body)
    results = r.get_json().get("results", [])
    assert (r.status_code == 200
            and all(x["status"] < 500 for x in results if "status" in x)), r.get_data()


def test_searchqa_first_tag_is_upstreams_regex():
    """first_tag replaced upstream's quadratic regex (searchqa.py): the same answers, found in
    linear time."""
    upstream = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    parts = ["<search>", "</search>", "<answer>", "</answer>", "<", ">", "/", "search", "x", " ",
             "\n"]

    @fuzz(300)
    @given(st.lists(st.sampled_from(parts) | texts, max_size=12).map("".join))
    def run(text):
        m = upstream.search(text)
        assert first_tag(text) == (None if m is None else (m[1], m[2]))

    run()
    t0 = time.perf_counter()
    assert first_tag("<search>" * 12500 + "</answer>") is None
    assert time.perf_counter() - t0 < 4.0  # 2 ms; 8 s with the regex (room for a loaded machine)


# ---------------------------------------------------------------- SciWorld: one JVM per instance
SCIWORLD_MISSING = ("the scienceworld package is not installed"
                    if importlib.util.find_spec("scienceworld") is None
                    else "java is not on PATH" if shutil.which("java") is None else None)


@pytest.mark.skipif(SCIWORLD_MISSING is not None,
                    reason=f"ScienceWorld cannot run: {SCIWORLD_MISSING}")
def test_sciworld():
    """The same properties on SciWorld, with few examples: each instance that is reset starts a JVM
    (~2 s, ~300-500 MB). At most two JVMs: instance 1's, and one for the fuzz's creates (later ones
    get the JVM cap's 503). Actions, reads and bodies mostly go to instance 1, whose JVM lives
    throughout."""
    app = new_app(SciWorldEnv,
                  SciWorldEnv.load_world(argparse.Namespace(max_jvms=2, jvm_heap_mb=512)))
    client = app.test_client()
    try:
        for body in ({}, {"data_idx": 0}):
            assert client.post("/create", json=body).status_code == 200

        @fuzz(10, jvm=True)
        @given(moves=st.lists(st.one_of(actions, st.sampled_from(["look around", "inventory",
                                                                  "open door to kitchen",
                                                                  "focus on agent"] + GET_PATHS)),
                              max_size=4))
        @example(moves=["\ud800", "look around"])  # a lone surrogate made py4j drop the JVM: a 503
        @example(moves=["a\nb", "x\\ny", "\x00", "open " + "door " * 19_999, "/expert_action"])
        def run_moves(moves):
            for move in moves:
                if move in GET_PATHS:
                    check(client.get(f"{move}?id=1"))
                    continue
                r = post(client, "/step", {"id": 1, "action": move})
                check(r, "POST")
                if r.status_code == 200 and r.get_json()["done"] or r.status_code == 409:
                    check(post(client, "/reset", {"id": 1, "data_idx": 0}), "POST")

        @fuzz(10, jvm=True)
        @given(path=st.sampled_from(["/step", "/batch", "/close"]),
               body=st.one_of(payloads, raw_bodies, batch_bodies))
        def run_bodies(path, body):
            check(post(client, path, body), "POST", capacity_ok=True)

        @fuzz(10, jvm=True)
        @given(path=st.sampled_from(GET_PATHS), query=queries)
        def run_queries(path, query):
            check(client.get(f"{path}?{query}"), capacity_ok=True)

        run_moves()
        run_bodies()
        run_queries()
        # Free the fuzz's instances (and the second JVM) for the closing episode.
        reg = app.extensions["registry"]
        for iid in [i for i in list(reg.instances) if i != 1]:
            client.post("/close", json={"id": iid})
        assert_still_serving(via(client))
    finally:
        app.extensions["registry"].stop()


# ---------------------------------------------------------------- a real server, raw sockets
def send_raw(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send exact bytes on a fresh connection, close our side, return all the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close first (a huge header); its answer is still readable
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def check_raw(answer: bytes, what: str = "") -> None:
    """The property on raw answers: no 5xx, and every 4xx is a JSON object with an "error", the
    app's and those waitress gives itself to what it cannot parse (400 bad start line, 431 huge
    header, 413 past its body cap) alike. Its 501 to a Transfer-Encoding it does not know is the
    answer HTTP prescribes (RFC 9112, 6.1): allowed, as JSON too."""
    if not answer:
        return  # an incomplete request, closed by us: waitress drops it unanswered
    head, _, rest = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(h[15:]) for h in head.split(b"\r\n")
                   if h.lower().startswith(b"content-length:")), 0)
    if status >= 400 and rest[:length]:  # no body: a HEAD request
        assert b"content-type: application/json" in head.lower(), (what, answer[:500])
        error = json.loads(rest[:length])["error"]
        assert isinstance(error, str), (what, answer[:500])
        if status == 501 and "Transfer-Encoding requested is not supported" in error:
            return
    assert status < 500, (what, answer[:500])


MALFORMED = {
    "garbage request line": b"GARBAGE\r\n\r\n",
    "nul bytes": b"\x00\x01\xff\r\n\r\n",
    "http/0.9": b"GET /\r\n\r\n",
    "unknown version": b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    "raw utf-8 in the path": "GET /\u00f8?id=\u2603 HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
    "content-length not a number": b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "negative content-length": b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    "content-length too long": (b'POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n'
                                b'\r\n{"id": 0}'),
    "content-length too short": (b'POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n'
                                 b'\r\n{"id": 0, "action": "x"}'),
    "content-length past waitress's cap": (b"POST /step HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Length: 10000000000\r\n\r\n"),
    "bad chunk size": (b"POST /step HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"zz\r\nabc\r\n0\r\n\r\n"),
    "unknown transfer-encoding": b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: 0\r\n\r\n",
    "chunked and content-length": (b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "huge header": b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 300_000 + b"\r\n\r\n",
    "5000 headers": (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(5000))
                     + b"\r\n"),
    "pipelined garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n"
                          b"GET /tasks HTTP/1.1\r\n\r\n"),
}


def test_malformed_http():
    url, stop = serve_in_thread(TextCraftEnv, world("textcraft"), max_body_bytes=1 << 16,
                                first_id=0, idle_timeout_s=0)
    port = urlsplit(url).port
    try:
        for name, data in MALFORMED.items():
            check_raw(send_raw(port, data), name)
        # Past the app's body limit: the app's own 413, as JSON, whether sized up front or chunked.
        big = b"x" * 100_000
        for framing in (b"Content-Length: %d\r\n\r\n" % len(big) + big,
                        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(big) + big
                        + b"\r\n0\r\n\r\n"):
            answer = send_raw(port, b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                    b"Content-Type: application/json\r\n" + framing)
            assert answer.startswith(b"HTTP/1.1 413") and b'{"error": ' in answer, answer[:300]

        header_names = st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Content-Type",
                                        b"Expect", b"Connection", b"Host",
                                        b"Origin"]) | st.binary(max_size=8)
        header_values = st.sampled_from([b"0", b"-1", b"7", b"99999", b"chunked", b"100-continue",
                                         b"close", b"127.0.0.1", b"127.0.0.1:99999",
                                         b"application/json", b"http://[", b"null"])
        header_values |= st.binary(max_size=12)

        @fuzz(40)
        @given(method=methods.map(str.encode) | st.binary(max_size=8),
               path=paths.map(str.encode) | st.binary(max_size=20),
               headers=st.lists(st.tuples(header_names, header_values), max_size=4),
               body=raw_bodies.map(lambda b: b[:70_000]))
        def run(method, path, headers, body):
            lines = [method + b" " + path + b" HTTP/1.1"] + [k + b": " + v for k, v in headers]
            check_raw(send_raw(port, b"\r\n".join(lines) + b"\r\n\r\n" + body))

        run()
        assert_still_serving(functools.partial(raw, url))
    finally:
        stop()
