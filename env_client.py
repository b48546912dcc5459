"""Client side of the env protocol (docs/environments.md): `EnvClient` for one instance,
`EnvPool` for many. It plays this project's servers and AgentGym's own; each AgentGym
dialect (`env_idx` ids, bare answers, `score` or `reward`, WebArena's terminated/truncated,
errors sent as HTTP 200) is handled where it is read, with a comment.

The contract (docs/reliability.md): every failure, a malformed answer included (a NaN or
missing reward, a done of "false"), raises or returns an `EnvError`, never a reward of 0;
the rollout drops such trajectories from the loss. Only calls that cannot change the game
are retried (never `step`); a create's `request_key`, the same on each retry, makes a server
that lost its answer give the same instance back; `EnvPool` replaces instances lost with
their server at the next reset.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import urllib3

# ---------------------------------------------------------------- errors and results
class EnvError(RuntimeError):
    """A failure talking to an env server, never a game outcome.
    kind: "timeout" | "connection" | "http" (a 4xx/5xx) | "env" (an error body) | "protocol"
    (a malformed answer)."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(f"[{kind}{'' if status is None else f' {status}'}] {message}")
        self.kind, self.status, self.message = kind, status, message

    @property
    def instance_lost(self) -> bool:
        """The instance may be gone: no server (down, restarted), unknown id, hung call."""
        return self.kind in ("connection", "timeout") or (
            self.kind == "http" and self.status in (404, 503, 504))


@dataclass
class Step:
    observation: str
    # `score` where the server sends one (BabyAI, SciWorld), else `reward`; the game's scale
    reward: float
    done: bool
    raw: dict = field(default_factory=dict)  # the whole answer (info, step reward, ...)


# ---------------------------------------------------------------- HTTP on urllib3
MAX_IDLE_S = 1.0  # a kept connection unused for longer is not reused (see Transport)
# The most an answer may hold (a /batch answer: this per op). Observations run from a few
# hundred bytes (TextCraft) to a few hundred KB (a WebArena page); far more is a server gone
# wrong, which would cost seconds and gigabytes to tokenize and log. The default of every
# Transport made after `cap_answers` (the scripts' --env-max-answer-mb) changes it.
MAX_ANSWER_BYTES = 4 * 2**20
_lock = threading.Lock()
_calls: dict[int, list] = {}  # thread id -> [deadline, socket waited on, its connection]


class _Watched:
    """A urllib3 connection the watchdog may shut down past its call's deadline, and that
    the pool takes for dropped once unused for MAX_IDLE_S."""

    owner, sent = None, -math.inf

    @property
    def is_connected(self) -> bool:  # asked before a kept connection is handed out again
        with _lock:  # taken over: the watchdog has shut it already (seen below) or never will
            self.owner = threading.get_ident()
        return time.monotonic() - self.sent < MAX_IDLE_S and super().is_connected

    def request(self, *args, **kw):
        super().request(*args, **kw)
        self.sent = time.monotonic()
        with _lock:  # the socket itself: a closing answer takes it from `sock`
            self.owner = threading.get_ident()
            if self.owner in _calls:
                _calls[self.owner][1:] = [self.sock, self]


def _watch() -> None:
    """Shut down the socket of each call past its deadline: the read it waits in ends."""
    while True:
        time.sleep(0.05)
        with _lock:
            for owner, call in _calls.items():
                deadline, sock, conn = call
                if deadline < time.monotonic() and sock is not None and conn.owner == owner:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    call[1] = None  # shut: not again


def cap_answers(mb: float) -> None:
    """--env-max-answer-mb: the answer cap of the env clients this process makes from now
    on (the scripts make their pools from an address alone: rollout.py, trainer/setup.py)."""
    global MAX_ANSWER_BYTES
    MAX_ANSWER_BYTES = max(1, int(mb * 2**20))


@functools.cache
def _start_watchdog(pid: int) -> None:  # one per process: a forked child starts its own
    threading.Thread(target=_watch, name="env-client-deadlines", daemon=True).start()


class Transport:
    """JSON over HTTP to one server, on urllib3's thread-safe keep-alive pool (it copes with
    every stack in tests/test_server_stacks.py, and resends nothing unless told to). A
    `step` is never retried, so it must not meet a connection the server closed while idle
    (uvicorn after 5 s, gunicorn after 2 s): a kept one is reused only while unused for
    under MAX_IDLE_S. `timeout` bounds each attempt as a whole (urllib3's, each read): a
    watchdog shuts down the socket of a call past its deadline, however slowly its answer
    trickles in."""

    def __init__(self, base_url: str, timeout: float = 120.0, retries: int = 2,
                 max_answer_bytes: int | None = None):  # None: MAX_ANSWER_BYTES
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad env server address {base_url!r}; "
                             "expected http://HOST:PORT")
        self.base_url, self.prefix = f"{u.scheme}://{u.netloc}", u.path.rstrip("/")
        self.timeout, self.retries = timeout, retries  # timeout: each attempt's, as a whole
        self.max_answer_bytes = max_answer_bytes or MAX_ANSWER_BYTES
        self.pool = self._new_pool()
        _start_watchdog(os.getpid())

    def _new_pool(self):
        # maxsize: connections kept for reuse, one per concurrent caller (EnvPool's workers)
        pool = urllib3.connection_from_url(self.base_url, maxsize=256, retries=False)
        # urllib3's HTTP or HTTPS connection, watched
        pool.ConnectionCls = type("Connection", (_Watched, pool.ConnectionCls), {})
        return pool

    def close(self) -> None:  # later requests open new connections
        old, self.pool = self.pool, self._new_pool()
        old.close()

    def _send(self, method: str, path: str, body, headers: dict, max_bytes: int):
        """One attempt, within `timeout` in all: the answer's (status, body) or an EnvError. A
        redirect is not followed (it is an HTTP error); at most `max_bytes` are read."""
        deadline, me = time.monotonic() + self.timeout, threading.get_ident()
        with _lock:
            _calls[me] = [deadline, None, None]
        try:
            r = self.pool.urlopen(method, self.prefix + path, body=body, headers=headers,
                                  timeout=urllib3.Timeout(total=self.timeout), redirect=False,
                                  preload_content=False)
            data = r.read(max_bytes + 1)
            if len(data) > max_bytes:
                r.close()  # not drained: the rest is never read
                raise EnvError("protocol", f"{method} {path}: answer over {max_bytes} bytes")
            r.release_conn()
            return r.status, data
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise self._failure(method, path, e, deadline) from None
        finally:
            with _lock:
                del _calls[me]

    def _failure(self, method: str, path: str, e: Exception, deadline: float) -> EnvError:
        """An attempt urllib3 or its socket gave up: "timeout" (urllib3's, or past the
        deadline, where the watchdog shut the socket down) or "connection"."""
        timed_out = isinstance(e, urllib3.exceptions.TimeoutError) and not isinstance(
            e, urllib3.exceptions.NewConnectionError)  # (a refusal, despite its class)
        if timed_out or time.monotonic() >= deadline:
            return EnvError("timeout", f"{method} {path}: no complete answer within the "
                                       f"{self.timeout:g} s deadline ({e})")
        return EnvError("connection", f"{method} {path} to {self.base_url}: "
                                      f"{type(e).__name__}: {e}")

    def request(self, method: str, path: str, payload=None, retry: bool = False,
                answers: int = 1):
        """The answer's JSON, or EnvError; `retry` (never a step's): `retries` more tries."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        cap = self.max_answer_bytes * answers  # answers: the ops a /batch answer holds
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                return _decode(method, path, *self._send(method, path, body, headers, cap))
            except EnvError as e:
                if e.kind not in ("timeout", "connection") or attempt + 1 == attempts:
                    raise
            time.sleep(min(0.1 * 2 ** attempt, 2.0))


def _decode(method: str, path: str, status: int, data: bytes):
    try:
        out = json.loads(data) if data else None
    except (ValueError, RecursionError) as e:  # RecursionError: deeper than json's stack
        raise _refusal(method, path, status, data, e) from None
    if status != 200 or isinstance(out, dict) and out.get("error") is not None:
        raise _refusal(method, path, status, data, out)
    return out


def _refusal(method: str, path: str, status: int, data: bytes, out) -> EnvError:
    """Why an answer is no success; `out`: its JSON, or the error json.loads raised."""
    if isinstance(out, (ValueError, RecursionError)):
        what = "nested too deep" if isinstance(out, RecursionError) else "not JSON"
        return EnvError("protocol" if status == 200 else "http",
                        f"{method} {path}: answer is {what}: {data[:200]!r}", status)
    if status != 200:
        msg = out.get("error") if isinstance(out, dict) else None
        detail = msg if msg else repr(data[:200])
        return EnvError("http", f"{method} {path}: {detail}", status)
    return EnvError("env", f"{method} {path}: {out['error']}")  # AgentGym's HTTP-200 error


# The largest float32: the trainer holds rewards as float32, where a larger one is infinite
FLOAT32_MAX = 3.4028234663852886e38


def _number(raw: dict, key: str) -> float:
    """raw[key] as a float; a bool, NaN, Infinity or one past float32's range is malformed."""
    v = raw[key]
    if type(v) is not bool and isinstance(v, (int, float)) and abs(v) <= FLOAT32_MAX:
        return float(v)
    raise EnvError("protocol", f"step answer with {key}={v!r}: not a float32 number")


def _flag(raw: dict, key: str) -> bool:
    """raw[key] as a bool, or the int 0 or 1; all else ("false") is malformed, not a guess."""
    v = raw.get(key, False)
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise EnvError("protocol", f"step answer with {key}={v!r}: not a bool")


def _step_from(raw) -> Step:
    if not isinstance(raw, dict) or "observation" not in raw:
        raise EnvError("protocol", f"step answer without an observation: {str(raw)[:200]}")
    values = {k: _number(raw, k) for k in ("score", "reward") if k in raw}  # both checked
    if not values or not {"done", "terminated", "truncated"} & raw.keys():
        raise EnvError("protocol", f"step answer without a reward or done: {str(raw)[:200]}")
    if "done" not in raw:
        return _webarena_step(raw, values)
    done, value = _flag(raw, "done"), values.get("score", values.get("reward", 0.0))
    return Step(_text(raw["observation"]), value, done, raw)


def _webarena_step(raw: dict, values: dict) -> Step:
    """WebArena's answer: terminated or truncated; its reward counts once terminated, as
    upstream."""
    terminated, truncated = _flag(raw, "terminated"), _flag(raw, "truncated")
    value = values.get("reward", 0.0) if terminated else 0.0
    return Step(_text(raw["observation"]), value, terminated or truncated, raw)


def _obs_from(raw) -> str:
    if isinstance(raw, dict) and "observation" in raw:
        task = raw.get("task_description")  # SciWorld's /reset: the task once, then the view
        raw = str(raw["observation"]) if task is None else f"{task}\n{raw['observation']}"
    return _text(raw if isinstance(raw, str) else json.dumps(raw))


def _text(x) -> str:
    """An observation as text a tokenizer takes: JSON may carry lone surrogates ("\\ud800"),
    which no UTF-8 text holds and tokenizers refuse; each becomes "?"."""
    x = str(x)
    return x if x.isascii() else x.encode("utf-8", "replace").decode("utf-8")


# ---------------------------------------------------------------- one instance
class EnvClient:
    """One env instance, created on the server at construction."""

    def __init__(self, base_url: str | Transport, timeout: float = 120.0, retries: int = 2,
                 max_answer_bytes: int | None = None):  # None: MAX_ANSWER_BYTES
        self.http = (base_url if isinstance(base_url, Transport)
                     else Transport(base_url, timeout, retries, max_answer_bytes))
        # "id": 0 is the task AgentGym's SearchQA server requires at create; others ignore it
        payload = {"request_key": str(uuid.uuid4()), "id": 0}
        created = self.http.request("POST", "/create", payload, retry=True)
        self.id_key, self.id = _read_id(created)
        # AgentGym's WebArena server (`{"env_idx"}` from /create) answers /reset with the
        # bare page; the agent's observation (objective, URL, tree, last action) is what
        # /observation renders.
        self.observe_after_reset = isinstance(created, dict) and "env_idx" in created
        self.closed = False

    def _with_id(self, payload: dict) -> dict:
        return {self.id_key: self.id, **payload}

    def reset(self, item_id: int) -> str:
        body = {"data_idx": item_id}
        # AgentGym's servers: SearchQA reads the task as `id`, WebArena as `idx`
        if self.id_key == "env_idx":
            body.update(id=item_id, idx=item_id, seed=0)
        raw = self.http.request("POST", "/reset", self._with_id(body), retry=True)
        # WebArena's answer when the task's start page did not load
        if isinstance(raw, dict) and raw.get("observation") == "TimeoutError":
            raise EnvError("env",
                           f"POST /reset: task {item_id} timed out loading its start page")
        # the observation, bare (a str: AgentGym's SearchQA) or in a dict
        answered = isinstance(raw, str) or isinstance(raw, dict) and "observation" in raw
        if answered and not self.observe_after_reset:
            return _obs_from(raw)
        return self.observation()

    def step(self, action: str) -> Step:
        raw = self.http.request("POST", "/step", self._with_id({"action": action}))
        return _step_from(raw)

    def _get(self, route: str):
        """GET /route about this instance: it changes nothing, so it is retried."""
        return self.http.request("GET", f"/{route}?{self.id_key}={self.id}", retry=True)

    def observation(self) -> str:
        return _obs_from(self._get("observation"))

    def available_actions(self) -> list[str]:
        raw = self._get("available_actions")
        return list(raw) if isinstance(raw, list) else raw

    def detail(self) -> dict:
        return self._get("detail")

    def expert_action(self) -> str | None:
        """The env's expert's next action (this project's servers only)."""
        return self._get("expert_action")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.http.request("POST", "/close", self._with_id({}), retry=False)
            except EnvError as e:
                if e.kind != "protocol":  # WebArena answers a plain-text "closed": a success
                    raise


def _read_id(created) -> tuple[str, int]:
    if isinstance(created, int) and not isinstance(created, bool):
        return "env_idx", created  # AgentGym SearchQA answers a bare id
    if isinstance(created, dict):
        for key in ("id", "env_idx"):
            if isinstance(created.get(key), int):
                return key, created[key]
    raise EnvError("protocol",
                   f"/create answered without an instance id: {str(created)[:200]}")


# ---------------------------------------------------------------- many instances
def _room(health) -> int | None:
    """How many more instances a server's health answer says it can create, or None."""
    if not isinstance(health, dict):
        return None
    top, now = health.get("max_instances"), health.get("instances")
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (top, now))
    return top - now if ok else None


def _guarded(fn, x):
    """fn(x), or the EnvError it raised: one instance's failure never stops the others."""
    try:
        return fn(x)
    except EnvError as e:
        return e


class EnvPool:
    """`size` instances on one server, reset and stepped together: through `/batch` where
    the server has it, else one request per instance from `workers` threads. A failure comes
    back as that instance's `EnvError` in the result list: it never raises or stops others."""

    def __init__(self, base_url: str, size: int, timeout: float = 120.0, retries: int = 2,
                 workers: int = 32, use_batch: bool | None = None, batch_chunk: int = 64,
                 max_answer_bytes: int | None = None):  # None: MAX_ANSWER_BYTES
        self.http = Transport(base_url, timeout, retries, max_answer_bytes)
        self.size = size
        self.executor = ThreadPoolExecutor(max(1, min(workers, size)), "env-pool")
        self.batch_chunk = batch_chunk
        health = self._health()
        if use_batch is None:
            use_batch = isinstance(health, dict) and bool(health.get("batch"))
        self.use_batch = use_batch
        room = _room(health)
        if room is not None and size > room:  # refused now, not after `size` refusals
            self.executor.shutdown()
            raise EnvError("env", f"a pool of {size} instances (--batch-size x --group-size) "
                                  f"does not fit the server at {base_url}: it has room for "
                                  f"{room} (its --max-instances {health['max_instances']})", 503)
        self.clients: list[EnvClient | None] = [None] * size
        made = self._map(lambda i: EnvClient(self.http), range(size))
        errors = [m for m in made if isinstance(m, EnvError)]
        self.clients = [m if isinstance(m, EnvClient) else None for m in made]
        if errors:
            self.close()
            first = errors[0]
            raise EnvError(first.kind, f"could not create {len(errors)}/{size} instances: "
                           f"{first.message}", first.status)

    def _health(self):
        try:
            return self.http.request("GET", "/", retry=True)
        except EnvError:
            return None  # AgentGym's health answers plain text; fall back to single requests

    def _map(self, fn, items) -> list:
        return list(self.executor.map(functools.partial(_guarded, fn), items))

    def _batch(self, ops: list[dict], parse) -> list:
        """Ops in parallel chunks -> each op's answer read by `parse`, or its EnvError."""
        chunks = [ops[i:i + self.batch_chunk] for i in range(0, len(ops), self.batch_chunk)]
        retry = all(op["op"] != "step" for op in ops)

        def send(chunk):
            n = len(chunk)
            try:
                res = self.http.request("POST", "/batch", {"ops": chunk}, retry=retry,
                                        answers=n)["results"]
                if len(res) != n:
                    raise EnvError("protocol", f"/batch: {len(res)} results for {n} ops")
            except EnvError as e:
                return [e] * n
            except (KeyError, TypeError):
                return [EnvError("protocol", "/batch answer without a results list")] * n
            return [_guarded(parse, r) if not (isinstance(r, dict) and "error" in r)
                    else EnvError("http", r["error"], r.get("status")) for r in res]
        return [r for part in self.executor.map(send, chunks) for r in part]

    def reset(self, item_ids: list[int | None]) -> list[str | EnvError | None]:
        """Reset instance i to task item_ids[i] (None: untouched) -> first observations."""
        assert len(item_ids) == self.size, f"need {self.size} item ids, got {len(item_ids)}"
        out: list = [None] * self.size
        todo = [i for i, t in enumerate(item_ids) if t is not None]
        ready = self._live(todo, out)
        for i, r in zip(ready, self._reset_now(ready, item_ids)):
            out[i] = r
        lost = [i for i in todo if isinstance(out[i], EnvError) and out[i].instance_lost]
        if lost:
            self._reset_anew(out, lost, item_ids)
        return out

    def _reset_anew(self, out: list, lost: list[int], item_ids) -> None:
        """Reset's recovery: a new instance in each slot of `lost` (gone with its server,
        hung, or never made), then its reset. A slot that held none (its last create failed)
        gets a second round if the first ends lost too: its new instance may be lost as any
        other."""
        empty = [i for i in lost if self.clients[i] is None]
        for _ in range(2):
            for i, made in zip(lost, self._map(self._renew, lost)):
                if isinstance(made, EnvError):
                    out[i] = made
            ready = [i for i in lost if self.clients[i] is not None]
            for i, r in zip(ready, self._reset_now(ready, item_ids)):
                out[i] = r
            lost = [i for i in empty if isinstance(out[i], EnvError) and out[i].instance_lost]

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
            return self._batch([{"op": "reset", "id": self.clients[i].id,
                                 "data_idx": item_ids[i]} for i in todo], _obs_from)
        return self._map(lambda i: self.clients[i].reset(item_ids[i]), todo)

    def step(self, actions: list[str | None]) -> list[Step | EnvError | None]:
        """Step instance i with actions[i] (None: skip it, e.g. a finished trajectory)."""
        assert len(actions) == self.size, f"need {self.size} actions, got {len(actions)}"
        out: list = [None] * self.size
        todo = self._live([i for i, a in enumerate(actions) if a is not None], out)
        if self.use_batch:
            res = self._batch([{"op": "step", "id": self.clients[i].id, "action": actions[i]}
                               for i in todo], _step_from)
        else:
            res = self._map(lambda i: self.clients[i].step(actions[i]), todo)
        for i, r in zip(todo, res):
            out[i] = r
        return out

    def _live(self, todo: list[int], out: list) -> list[int]:
        """The slots in todo holding an instance; each other one's out says it holds none."""
        for i in todo:
            if self.clients[i] is None:
                out[i] = EnvError("connection",
                                  f"pool slot {i} has no instance (lost with its server)")
        return [i for i in todo if self.clients[i] is not None]

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
