"""Client side of the env protocol: one `EnvClient` per instance, and `EnvPool` for many.

Drives this project's servers and AgentGym's own (FastAPI) servers alike:
- instance ids travel as `id` or, for AgentGym's SearchQA/WebArena servers, as `env_idx`; `/create` may
  answer `{"id"}`, `{"env_idx"}` or a bare integer; the dialect is read off that first answer;
- a create carries `"id": 0`, the task AgentGym's SearchQA server requires there (the others ignore it);
  with `env_idx` a reset names its task `id` (SearchQA) and `idx` (WebArena) too, and may answer the bare
  observation (SearchQA);
- the value of a step is `score` where the server sends one (BabyAI, SciWorld), else `reward`, on the
  server's own scale: SciWorld's is 0-100, as AgentGym's server and this project's both send it.
  `train_reward(env, value)` divides by the env's `SCORE_SCALES` entry; the rollout applies it, so the
  trainer sees 0-1 (success = 1) for every game;
- `done` may come as `terminated`/`truncated` (WebArena), whose reward counts only once terminated and
  whose /reset answers the bare page, so the client reads the agent's observation from /observation;
- AgentGym's servers have no /tasks: `task_splits` then takes the ids from a file or the env's defaults;
- AgentGym servers report errors as HTTP 200 with `{"error": ...}`; they become `EnvError` here too.

Every failure (timeout, refused connection, HTTP error, error body, malformed answer) raises or returns
an `EnvError`, never a reward of 0: the rollout counts such trajectories and drops them from the loss.
A reward, score or done that is not a finite number or a bool (NaN, "false") is such a malformed answer.
Retries happen only where repeating the call cannot change the game (create, reset, reads, close);
`step` is sent at most once, and never on a connection the server may have closed. The timeout bounds
each call as a whole, however slowly the server sends. A create carries a `request_key` of its own, the
same on each retry, so that a server that made the instance but whose answer was lost gives that
instance again instead of a second one (AgentGym's servers ignore the field). An `EnvPool` replaces
instances lost with their server (killed, restarted, hung) at the next reset, so training picks up
again as soon as the server is back.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import math
import select
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# ---------------------------------------------------------------- errors and results
class EnvError(RuntimeError):
    """An infrastructure or protocol failure talking to an env server (not a game outcome).

    kind: "timeout" | "connection" | "http" (a 4xx/5xx) | "env" (an error body) | "protocol" (bad answer)
    """

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(f"[{kind}{'' if status is None else f' {status}'}] {message}")
        self.kind, self.status, self.message = kind, status, message

    @property
    def instance_lost(self) -> bool:
        """The instance may be gone: no server (down, restarted), unknown id, hung or unanswered call."""
        return self.kind in ("connection", "timeout") or (self.kind == "http" and self.status in (404, 503, 504))


@dataclass
class Step:
    observation: str
    reward: float  # the step's value: `score` where the server has one, else `reward`; the server's scale
    done: bool
    raw: dict = field(default_factory=dict)  # the server's whole answer (info, step reward, ...)


# ---------------------------------------------------------------- HTTP with keep-alive
def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:  # (a socket timeout of 0 would mean non-blocking, not "no time left")
        raise TimeoutError("deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read waiting only for the time left before the call's deadline. A socket
    timeout alone bounds each read: a server trickling its answer a byte at a time would never be cut off."""

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        self.sock.settimeout(_time_left(self.deadline))
        return self.sock.recv_into(b)


class _DeadlineResponse(http.client.HTTPResponse):
    """An HTTPResponse that reads its status line, headers and body through a _DeadlineReader."""

    def __init__(self, sock, *args, deadline: float, **kw):
        super().__init__(sock, *args, **kw)
        self.fp.close()  # the plain reader made by the base class; nothing was read from it yet
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))


def _closed_by_peer(sock) -> bool:
    """Whether a kept connection is unfit to send on, checked without waiting: between calls the server
    sends nothing, so a readable socket means it closed (EOF), reset it, or sent bytes nobody asked for."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class Transport:
    """JSON over HTTP/1.1 keep-alive to one server: one connection per thread, reopened when stale.

    A `step` is never retried: the server may have applied it before the failure, and sending it again
    would play the action twice. So it must not be lost to a stale connection instead: servers close
    keep-alive connections left idle (uvicorn, which runs AgentGym's servers, after 5 s; gunicorn after
    2 s), and a request sent on one they closed fails. A kept connection is reused only while it has been
    idle for under `max_idle_s`, well inside those timeouts, and only if a zero-wait poll shows that the
    server has not closed it anyway (restarted, or a shorter timeout); otherwise the call opens a fresh
    one, at the cost of one TCP handshake.
    """

    def __init__(self, base_url: str, timeout: float = 120.0, retries: int = 2, max_idle_s: float = 1.0):
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad env server address {base_url!r}; expected http://HOST:PORT")
        self.base_url = f"{u.scheme}://{u.netloc}"
        self.host, self.port, self.https = u.hostname, u.port, u.scheme == "https"
        self.prefix = u.path.rstrip("/")
        self.timeout, self.retries = timeout, retries  # timeout: for each attempt of a call, as a whole
        self.max_idle_s = max_idle_s
        self._local = threading.local()
        self._all: set = set()  # every open connection, so that close() reaches other threads' too
        self._all_lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is not None and (time.monotonic() - self._local.used > self.max_idle_s
                              or c.sock is not None and _closed_by_peer(c.sock)):
            self._drop()
            c = None
        if c is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            c = self._local.conn = cls(self.host, self.port, timeout=self.timeout)
            with self._all_lock:
                self._all.add(c)
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            with self._all_lock:
                self._all.discard(c)
        self._local.conn = None

    def close(self) -> None:
        """Close every keep-alive connection (of all threads); later requests open new ones."""
        with self._all_lock:
            conns, self._all = self._all, set()
        for c in conns:
            c.close()

    def _send(self, method: str, path: str, body, headers: dict, deadline: float):
        """One attempt: connect (where needed), send, and read the whole answer by `deadline`."""
        conn = self._conn()
        if conn.sock is None:
            conn.timeout = _time_left(deadline)
            conn.connect()
        conn.sock.settimeout(_time_left(deadline))  # sendall's timeout covers all of the request
        conn.response_class = functools.partial(_DeadlineResponse, deadline=deadline)  # this attempt's
        conn.request(method, self.prefix + path, body, headers)
        resp = conn.getresponse()
        data = resp.read()
        self._local.used = time.monotonic()
        if resp.getheader("Connection", "").lower() == "close":
            self._drop()
        return resp.status, data

    def request(self, method: str, path: str, payload=None, retry: bool = False):
        """Send one request; return the decoded JSON answer or raise EnvError. Each attempt has
        `timeout` seconds in all; `retry` (never for a step) allows `retries` more after a failure."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                status, data = self._send(method, path, body, headers, time.monotonic() + self.timeout)
            except (socket.timeout, TimeoutError) as e:
                self._drop()  # an answer may still be on its way: that connection is out of step
                err = EnvError("timeout", f"{method} {path}: no complete answer within the {self.timeout:g} s "
                                          f"deadline ({e})")
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                err = EnvError("connection", f"{method} {path} to {self.base_url}: {type(e).__name__}: {e}")
            else:
                return _decode(method, path, status, data)
            if attempt + 1 < attempts:
                time.sleep(min(0.1 * 2 ** attempt, 2.0))
        raise err


def _decode(method: str, path: str, status: int, data: bytes):
    try:
        out = json.loads(data) if data else None
    except ValueError:
        raise EnvError("protocol" if status == 200 else "http",
                       f"{method} {path}: answer is not JSON: {data[:200]!r}", status) from None
    if status != 200:
        msg = out.get("error") if isinstance(out, dict) else None
        raise EnvError("http", f"{method} {path}: {msg if msg else repr(data[:200])}", status)
    if isinstance(out, dict) and "error" in out and out["error"] is not None:
        raise EnvError("env", f"{method} {path}: {out['error']}")  # AgentGym's HTTP-200 error
    return out


def _number(raw: dict, key: str) -> float:
    """raw[key] as a finite float. json.loads reads NaN and Infinity, and a bool is an int to Python:
    neither is a reward to train on."""
    v = raw[key]
    try:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    except OverflowError:  # an int too large for a float
        pass
    raise EnvError("protocol", f"step answer with {key}={v!r}: not a finite number")


def _flag(raw: dict, key: str) -> bool:
    """raw[key] as a bool; the ints 0 and 1 pass too (some servers send them). bool("false") is True, so
    anything else is a malformed answer rather than a guess."""
    v = raw.get(key, False)
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise EnvError("protocol", f"step answer with {key}={v!r}: not a bool")


def _step_from(raw) -> Step:
    if not isinstance(raw, dict) or "observation" not in raw:
        raise EnvError("protocol", f"step answer without an observation: {str(raw)[:200]}")
    values = {k: _number(raw, k) for k in ("score", "reward") if k in raw}  # both checked, whichever counts
    if "done" in raw:
        done = _flag(raw, "done")
        value = values.get("score", values.get("reward", 0.0))
    else:  # WebArena: terminated/truncated; the evaluator's reward counts once terminated, as upstream
        terminated, truncated = _flag(raw, "terminated"), _flag(raw, "truncated")
        done = terminated or truncated
        value = values.get("reward", 0.0) if terminated else 0.0
    return Step(str(raw["observation"]), value, done, raw)


def _obs_from(raw) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and "observation" in raw:
        return str(raw["observation"])
    return json.dumps(raw)


# ---------------------------------------------------------------- one instance
class EnvClient:
    """One env instance on a server: `reset(item_id)`, `observation()`, `available_actions()`,
    `step(action)`, `close()`. Created on the server at construction."""

    def __init__(self, base_url: str | Transport, timeout: float = 120.0, retries: int = 2):
        self.http = base_url if isinstance(base_url, Transport) else Transport(base_url, timeout, retries)
        created = self.http.request("POST", "/create", {"request_key": str(uuid.uuid4()), "id": 0}, retry=True)
        self.id_key, self.id = _read_id(created)
        # AgentGym's WebArena server (`{"env_idx"}` from /create) answers /reset with the bare page tree;
        # the agent's observation (objective, URL, tree, previous action) is what /observation renders.
        self.observe_after_reset = isinstance(created, dict) and "env_idx" in created
        self.closed = False

    def _with_id(self, payload: dict) -> dict:
        return {self.id_key: self.id, **payload}

    def reset(self, item_id: int) -> str:
        body = {"data_idx": item_id}
        if self.id_key == "env_idx":  # AgentGym's SearchQA server reads the task as `id`, WebArena's as `idx`
            body.update(id=item_id, idx=item_id, seed=0)
        raw = self.http.request("POST", "/reset", self._with_id(body), retry=True)
        if isinstance(raw, dict) and raw.get("observation") == "TimeoutError":  # WebArena's failed page load
            raise EnvError("env", f"POST /reset: task {item_id} timed out loading its start page")
        if isinstance(raw, str) and not self.observe_after_reset:  # AgentGym's SearchQA: the observation
            return raw
        if isinstance(raw, dict) and "observation" in raw and not self.observe_after_reset:
            return str(raw["observation"])
        return self.observation()

    def step(self, action: str) -> Step:
        return _step_from(self.http.request("POST", "/step", self._with_id({"action": action})))

    def observation(self) -> str:
        return _obs_from(self.http.request("GET", f"/observation?{self.id_key}={self.id}", retry=True))

    def available_actions(self) -> list[str]:
        raw = self.http.request("GET", f"/available_actions?{self.id_key}={self.id}", retry=True)
        return list(raw) if isinstance(raw, list) else raw

    def detail(self) -> dict:
        return self.http.request("GET", f"/detail?{self.id_key}={self.id}", retry=True)

    def expert_action(self) -> str | None:
        """The env's expert's next action (this project's servers only)."""
        return self.http.request("GET", f"/expert_action?{self.id_key}={self.id}", retry=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.http.request("POST", "/close", self._with_id({}), retry=False)
            except EnvError as e:
                if e.kind != "protocol":  # WebArena answers a plain-text "closed": that is a success
                    raise


def _read_id(created) -> tuple[str, int]:
    if isinstance(created, int) and not isinstance(created, bool):
        return "env_idx", created  # AgentGym SearchQA answers a bare id
    if isinstance(created, dict):
        for key in ("id", "env_idx"):
            if isinstance(created.get(key), int):
                return key, created[key]
    raise EnvError("protocol", f"/create answered without an instance id: {str(created)[:200]}")


# ---------------------------------------------------------------- reward scales
# What a game's step value (Step.reward) is divided by to be a reward on the trainer's scale, where
# success = 1. SciWorld's score runs 0-100 (negative after a fatal mistake); the other games are 0-1.
SCORE_SCALES = {"sciworld": 100.0}


def train_reward(env: str, value: float) -> float:
    """A step's value from `env`'s server, on the trainer's 0-1 scale."""
    return value / SCORE_SCALES.get(env, 1.0)


# ---------------------------------------------------------------- task lists
# Envs served by other projects, whose servers have no /tasks: how many task ids they take.
REMOTE_TASKS = {"webarena": 812}  # WebArena's config_files/0.json .. 811.json
# The env part of the original release's item ids ("textcraft_12") -> this project's env names.
ITEM_PREFIXES = {"textcraft": "textcraft", "babyai": "babyai", "sciworld": "sciworld", "searchqa": "searchqa",
                 "webarena": "webarena"}


def item_id(env: str, x, num_tasks: int | None = None) -> int:
    """A task id from an id list: an int, an original-release item id "<env>_<n>", or an object with an
    `item_id` field holding either. Raises ValueError for an id `env` does not have."""
    if isinstance(x, dict):
        if "item_id" not in x:
            raise ValueError(f"an id object needs an 'item_id' field, got keys {sorted(x)[:5]}")
        return item_id(env, x["item_id"], num_tasks)
    if isinstance(x, str):
        prefix, _, n = x.rpartition("_")
        if not prefix or not n.isdigit():
            raise ValueError(f"item id {x!r} is not of the form '<env>_<n>'")
        if ITEM_PREFIXES.get(prefix, prefix) != env:
            raise ValueError(f"item id {x!r} is for {prefix!r}, not {env!r}")
        x = int(n)
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"a task id must be an integer, '<env>_<n>' or {{'item_id': ...}}, got {x!r}")
    if x < 0 or (num_tasks is not None and x >= num_tasks):
        raise ValueError(f"{env} has no task {x} (its tasks are 0..{(num_tasks or 1) - 1})")
    return x


def read_tasks_file(path: str, env: str, num_tasks: int | None, list_split: str) -> dict:
    """{"splits": {...}, "categories": {...}} from a JSON file: {"train": [...], "test": [...]} (or
    {"splits": {...}}, optionally "categories": {"12": "shopping"}), or a bare list of ids, which is the
    `list_split` split. Ids as `item_id` reads them."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, list):
            data = {list_split: data}
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object or list, got {type(data).__name__}")
        splits = data.get("splits", data)
        if not isinstance(splits, dict):
            raise ValueError("'splits' must be an object")
        for k in ("train", "test"):
            if k in splits and not isinstance(splits[k], list):
                raise ValueError(f"{k!r} must be a list of ids")
        splits = {k: [item_id(env, i, num_tasks) for i in v] for k, v in splits.items() if isinstance(v, list)}
        categories = {int(k): str(v) for k, v in data.get("categories", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--tasks-file {path}: {e}") from None
    if not any(splits.values()) and not any(k in splits for k in ("train", "test")):
        raise ValueError(f"--tasks-file {path}: no id list ('train', 'test', or a bare list)")
    return {"splits": splits, "categories": categories}


def task_splits(url: str, env: str, tasks_file: str | None = None, list_split: str = "train") -> dict:
    """{"splits": {"train": [...], "test": [...]}, "categories": {id: name}} of the tasks at `url`.

    From the server's /tasks (this project's servers), else the defaults of an env served elsewhere:
    WebArena's 812 ids with every fifth one held out. A `tasks_file` (read_tasks_file) replaces the
    splits it lists; its ids are checked against the server's task count where it is known.
    """
    served = None
    try:
        served = Transport(url).request("GET", "/tasks", retry=True)
        served = {"num_tasks": int(served["num_tasks"]), "splits": dict(served["splits"])}
    except EnvError as e:
        if e.kind in ("timeout", "connection"):
            raise  # no server there at all: say so, rather than guess its tasks
        served = None
    except (KeyError, TypeError, ValueError):
        served = None
    if served is None and env in REMOTE_TASKS:
        n = REMOTE_TASKS[env]
        served = {"num_tasks": n, "splits": {"train": [i for i in range(n) if i % 5], "test": list(range(0, n, 5))}}
    if tasks_file:
        given = read_tasks_file(tasks_file, env, served and served["num_tasks"], list_split)
        return {"splits": {**(served["splits"] if served else {}), **given["splits"]}, "categories": given["categories"]}
    if served is None:
        raise ValueError(f"the server at {url} does not list its tasks; give them with --tasks-file")
    return {"splits": served["splits"], "categories": {}}


def spread(ids: list[int], k: int) -> list[int]:
    """k ids spread evenly over the list (all of them when k is 0 or too large)."""
    if not k or k >= len(ids):
        return list(ids)
    return [ids[i * len(ids) // k] for i in range(k)]


# ---------------------------------------------------------------- many instances
class EnvPool:
    """`size` instances on one server, reset and stepped together.

    Uses the server's `/batch` endpoint when it has one (this project's servers), else one request per
    instance from `workers` threads, each on its own keep-alive connection. Per-instance failures come
    back as `EnvError` values in the result list; they never raise and never stop the other instances.
    """

    def __init__(self, base_url: str, size: int, timeout: float = 120.0, retries: int = 2,
                 workers: int = 32, use_batch: bool | None = None, batch_chunk: int = 64):
        self.http = Transport(base_url, timeout, retries)
        self.size = size
        self.executor = ThreadPoolExecutor(max(1, min(workers, size)), thread_name_prefix="env-pool")
        self.batch_chunk = batch_chunk
        if use_batch is None:
            health = self._health()
            use_batch = isinstance(health, dict) and bool(health.get("batch"))
        self.use_batch = use_batch
        self.clients: list[EnvClient | None] = [None] * size
        made = self._map(lambda i: EnvClient(self.http), range(size))
        errors = [m for m in made if isinstance(m, EnvError)]
        self.clients = [m if isinstance(m, EnvClient) else None for m in made]
        if errors:
            self.close()
            raise EnvError(errors[0].kind, f"could not create {len(errors)}/{size} instances: {errors[0].message}",
                           errors[0].status)

    def _health(self):
        try:
            return self.http.request("GET", "/", retry=True)
        except EnvError:
            return None  # AgentGym's health answers plain text; fall back to single requests

    def _map(self, fn, items) -> list:
        def guarded(x):
            try:
                return fn(x)
            except EnvError as e:
                return e
        return list(self.executor.map(guarded, items))

    def _batch(self, ops: list[dict]) -> list:
        """Send ops in chunks, in parallel; each op's answer, or its EnvError."""
        chunks = [ops[i:i + self.batch_chunk] for i in range(0, len(ops), self.batch_chunk)]
        retry = all(op["op"] != "step" for op in ops)

        def send(chunk):
            try:
                res = self.http.request("POST", "/batch", {"ops": chunk}, retry=retry)["results"]
                if len(res) != len(chunk):
                    raise EnvError("protocol", f"/batch answered {len(res)} results for {len(chunk)} ops")
            except EnvError as e:
                return [e] * len(chunk)
            except (KeyError, TypeError):
                return [EnvError("protocol", "/batch answer without a results list")] * len(chunk)
            return [EnvError("http", r["error"], r.get("status")) if isinstance(r, dict) and "error" in r
                    else r for r in res]

        return [r for part in self.executor.map(send, chunks) for r in part]

    def reset(self, item_ids: list[int | None]) -> list[str | EnvError | None]:
        """Reset instance i to task item_ids[i] (None: leave it alone). Returns first observations.
        An instance that is gone (its server was restarted, it hung, it was never created) is replaced
        by a new one and reset once more; what still fails comes back as its EnvError."""
        assert len(item_ids) == self.size, f"need {self.size} item ids, got {len(item_ids)}"
        todo = [i for i, t in enumerate(item_ids) if t is not None]
        out: list = [None] * self.size
        for again in (False, True):
            if again:
                todo = [i for i in todo if isinstance(out[i], EnvError) and out[i].instance_lost]
            renew = [i for i in todo if again or self.clients[i] is None]
            for i, made in zip(renew, self._map(self._renew, renew)):
                if isinstance(made, EnvError):
                    out[i] = made
            ready = [i for i in todo if self.clients[i] is not None]
            for i, r in zip(ready, self._reset_now(ready, item_ids)):
                out[i] = r
        return out

    def _renew(self, i: int) -> None:
        """A new instance in slot i; the old one is closed if its server still knows it."""
        old, self.clients[i] = self.clients[i], None
        if old is not None:
            try:
                old.close()
            except EnvError:
                pass  # gone with its server
        self.clients[i] = EnvClient(self.http)

    def _reset_now(self, todo: list[int], item_ids) -> list:
        if self.use_batch:
            res = self._batch([{"op": "reset", "id": self.clients[i].id, "data_idx": item_ids[i]} for i in todo])
            return [r if isinstance(r, EnvError) else _obs_from(r) for r in res]
        return self._map(lambda i: self.clients[i].reset(item_ids[i]), todo)

    def step(self, actions: list[str | None]) -> list[Step | EnvError | None]:
        """Step instance i with actions[i] (None: skip it, e.g. a finished trajectory)."""
        assert len(actions) == self.size, f"need {self.size} actions, got {len(actions)}"
        todo = [i for i, a in enumerate(actions) if a is not None]
        out: list = [None] * self.size
        for i in todo:
            if self.clients[i] is None:
                out[i] = EnvError("connection", f"pool slot {i} has no instance (lost with its server)")
        todo = [i for i in todo if out[i] is None]
        if self.use_batch:
            res = self._batch([{"op": "step", "id": self.clients[i].id, "action": actions[i]} for i in todo])
            for i, r in zip(todo, res):
                if not isinstance(r, EnvError):
                    try:
                        r = _step_from(r)
                    except EnvError as e:
                        r = e
                out[i] = r
        else:
            for i, r in zip(todo, self._map(lambda i: self.clients[i].step(actions[i]), todo)):
                out[i] = r
        return out

    def close(self) -> None:
        live = [c for c in self.clients if c is not None and not c.closed]
        self._map(lambda c: c.close(), live)
        self.clients = [None] * self.size
        self.executor.shutdown(wait=False)
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def env_ready(server, url: str, wait_s: float) -> None:
    """Before a training step: restart the local env server (an env_server.app.ServerProcess, or None)
    if it died; after a failed step, also wait up to
    `wait_s` for the server to answer (a restart elsewhere takes a while). The pool replaces the lost
    instances at its next reset."""
    from tqdm import tqdm  # writes between progress-bar updates

    deadline = time.time() + wait_s
    while True:
        if server is not None and not server.alive():
            tqdm.write(f"the env server died (exit code {server.proc.returncode}); restarting it on {server.url}")
            try:
                server.restart()
            except RuntimeError as e:
                tqdm.write(f"could not restart the env server: {e}")
        if wait_s <= 0:
            return
        try:
            Transport(url, timeout=5.0, retries=0).request("GET", "/")
            return
        except EnvError as e:
            if e.kind not in ("connection", "timeout"):
                return  # it answered (AgentGym's servers answer their health check in plain text)
            if time.time() > deadline:
                tqdm.write(f"the env server at {url} has not answered for {wait_s:g} s: {e}")
                return
        time.sleep(1.0)
