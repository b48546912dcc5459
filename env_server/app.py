"""One generic Flask app for every environment, speaking the AgentGym HTTP protocol.

    POST /create {"data_idx"?}          -> {"id", "observation", "reward", "done"}
    POST /reset  {"id", "data_idx"}      -> {"id", "observation", "reward", "score", "done"}
    POST /step   {"id", "action"}        -> {"observation", "reward", "score", "done", "info"}
    GET  /observation?id=                -> "text"
    GET  /available_actions?id=          -> ["...", ...]
    GET  /detail?id=                     -> {...}
    POST /close  {"id"}                  -> true
    POST /batch  {"ops": [{"op": "step"|"reset"|"create"|"close", ...}]} -> {"results": [...]}
    GET  /expert_action?id=              -> "the expert's next action" (tests, warm starts; not AgentGym)
    GET  /tasks                          -> {"num_tasks", "splits"}
    GET  /                               -> health

AgentGym's clients read these shapes, so they drive this server unchanged. `env_idx` is accepted as an
alias of `id` (AgentGym's SearchQA and WebArena servers use it). Unlike AgentGym, a caller's mistake is a
4xx with `{"error": ...}` (never HTTP 200), and a server bug is a logged 500: the server never dies.

Instances are kept in a dict under one lock; each has its own lock so that two requests for the same
instance never interleave, while requests for different instances run in parallel. Instances idle for
longer than `idle_timeout_s` are closed by a reaper thread, and live instances are capped.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from .base import Env, TaskError

log = logging.getLogger("env_server")


class ApiError(Exception):
    """A request the server refuses; becomes `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Instance:
    __slots__ = ("env", "lock", "last_used", "task", "done", "closed")

    def __init__(self, env: Env):
        self.env = env
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.task: int | None = None  # the task id of the running episode, None before the first reset
        self.done = False
        self.closed = False


class Registry:
    """Live instances, the id counter, the cap and the reaper."""

    def __init__(self, env_cls: type[Env], world, max_instances: int, idle_timeout_s: float):
        self.env_cls, self.world = env_cls, world
        self.num_tasks = env_cls.num_tasks(world)
        self.max_instances, self.idle_timeout_s = max_instances, idle_timeout_s
        self.instances: dict[int, Instance] = {}
        self.next_id = 0  # ids count up from 0 and are never reused, so a stale id can't hit a new game
        self.lock = threading.Lock()
        self.reaped = 0
        self._stop = threading.Event()
        if idle_timeout_s > 0:
            threading.Thread(target=self._reap_loop, name="env-reaper", daemon=True).start()

    def create(self) -> int:
        with self.lock:
            if len(self.instances) >= self.max_instances:
                raise ApiError(503, f"server full: {len(self.instances)} live instances (cap "
                                    f"--max-instances={self.max_instances}); close instances or raise the cap")
            iid, self.next_id = self.next_id, self.next_id + 1
            self.instances[iid] = None  # reserve the slot: env construction may be slow (a JVM)
        try:
            inst = Instance(self.env_cls(self.world))
        except BaseException:
            with self.lock:
                del self.instances[iid]
            raise
        with self.lock:
            self.instances[iid] = inst
        return iid

    def get(self, iid: int) -> Instance:
        inst = self.instances.get(iid)
        if inst is None or inst.closed:
            if 0 <= iid < self.next_id:
                raise ApiError(404, f"instance {iid} is closed (or was reaped after "
                                    f"{self.idle_timeout_s:g} s idle)")
            raise ApiError(404, f"unknown instance id {iid}")
        return inst

    def close(self, iid: int) -> None:
        inst = self.get(iid)
        with inst.lock:
            if inst.closed:
                raise ApiError(404, f"instance {iid} is closed")
            inst.closed = True
            with self.lock:
                self.instances.pop(iid, None)
            inst.env.close()

    def _reap_loop(self) -> None:
        period = min(max(self.idle_timeout_s / 4, 0.05), 30.0)
        while not self._stop.wait(period):
            self.reap()

    def reap(self) -> int:
        """Close every instance idle for longer than the timeout; return how many."""
        now, n = time.monotonic(), 0
        with self.lock:
            idle = [(i, x) for i, x in self.instances.items()
                    if x is not None and now - x.last_used > self.idle_timeout_s]
        for iid, inst in idle:
            if not inst.lock.acquire(blocking=False):
                continue  # busy right now, so not idle
            try:
                if inst.closed or time.monotonic() - inst.last_used <= self.idle_timeout_s:
                    continue
                inst.closed = True
                with self.lock:
                    self.instances.pop(iid, None)
                try:
                    inst.env.close()
                except Exception:
                    log.exception("closing reaped instance %d failed", iid)
                n += 1
            finally:
                inst.lock.release()
        self.reaped += n
        return n

    def stop(self) -> None:
        self._stop.set()
        with self.lock:
            live = [x for x in self.instances.values() if x is not None]
            self.instances.clear()
        for inst in live:
            try:
                inst.env.close()
            except Exception:
                log.exception("closing instance at shutdown failed")


# ---------------------------------------------------------------- request field checks
def _int(body: dict, *names: str) -> int:
    """The first of `names` present in `body`, which must be an integer (bools are not)."""
    for name in names:
        if name in body:
            v = body[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ApiError(400, f"field {name!r} must be an integer, got {type(v).__name__}")
            return v
    raise ApiError(400, f"missing field {names[0]!r}")


def _str(body: dict, name: str, max_len: int = 100_000) -> str:
    if name not in body:
        raise ApiError(400, f"missing field {name!r}")
    v = body[name]
    if not isinstance(v, str):
        raise ApiError(400, f"field {name!r} must be a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ApiError(400, f"field {name!r} is longer than {max_len} characters")
    return v


def _query_id() -> int:
    raw = request.args.get("id", request.args.get("env_idx"))
    if raw is None:
        raise ApiError(400, "missing query parameter 'id'")
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter 'id' must be an integer, got {raw[:40]!r}") from None


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj), status=status, mimetype="application/json")


# ---------------------------------------------------------------- the app
def create_app(env_cls: type[Env], world=None, *, max_instances: int = 1024, idle_timeout_s: float = 900.0,
               max_body_bytes: int = 1 << 20, max_batch_ops: int = 4096) -> Flask:
    """Build the Flask app serving `env_cls`. `world` defaults to `env_cls.load_world()`."""
    if world is None:
        world = env_cls.load_world(None)
    reg = Registry(env_cls, world, max_instances, idle_timeout_s)
    app = Flask(f"env_server.{env_cls.name}")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes  # werkzeug answers 413 past this
    app.extensions["registry"] = reg
    batch_threads = getattr(env_cls, "batch_threads", 1)
    pool = ThreadPoolExecutor(batch_threads, thread_name_prefix="env-batch") if batch_threads > 1 else None

    def body() -> dict:
        try:
            data = json.loads(request.get_data(cache=False) or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    def task_id(b: dict) -> int:
        idx = _int(b, "data_idx", "idx")
        if not 0 <= idx < reg.num_tasks:
            raise ApiError(400, f"task id {idx} out of range: {env_cls.name} has tasks 0..{reg.num_tasks - 1}")
        return idx

    # -- operations shared by the single endpoints and /batch; each returns a JSON-able value
    def op_create(b: dict) -> dict:
        idx = task_id(b) if ("data_idx" in b or "idx" in b) else None
        iid = reg.create()
        out = {"id": iid, "observation": "", "reward": 0, "done": False}
        if idx is not None:
            out = op_reset({"id": iid, "data_idx": idx})
        return out

    def op_reset(b: dict) -> dict:
        iid, idx = _int(b, "id", "env_idx"), task_id(b)
        inst = reg.get(iid)
        with inst.lock:
            if inst.closed:
                raise ApiError(404, f"instance {iid} is closed")
            inst.last_used = time.monotonic()
            obs = inst.env.reset(idx)
            inst.task, inst.done = idx, False
        return {"id": iid, "observation": obs, "reward": 0, "score": 0, "done": False}

    def op_step(b: dict) -> dict:
        iid, action = _int(b, "id", "env_idx"), _str(b, "action")
        inst = reg.get(iid)
        with inst.lock:
            if inst.closed:
                raise ApiError(404, f"instance {iid} is closed")
            if inst.task is None:
                raise ApiError(409, f"instance {iid} has no task yet: call /reset first")
            if inst.done:
                raise ApiError(409, f"the episode of instance {iid} is over: call /reset to start another")
            inst.last_used = time.monotonic()
            r = inst.env.step(action)
            inst.done = bool(r.done)
        score = r.reward if r.score is None else r.score
        return {"observation": r.observation, "reward": r.reward, "score": score, "done": bool(r.done),
                "info": r.info}

    def op_close(b: dict) -> bool:
        reg.close(_int(b, "id", "env_idx"))
        return True

    ops = {"create": op_create, "reset": op_reset, "step": op_step, "close": op_close}

    def read(iid: int, fn):
        inst = reg.get(iid)
        with inst.lock:
            if inst.closed:
                raise ApiError(404, f"instance {iid} is closed")
            inst.last_used = time.monotonic()
            return fn(inst)

    # -- routes
    @app.get("/")
    def health():
        return _json({"status": "ok", "env": env_cls.name, "protocol": "agentgym", "batch": True,
                      "instances": len(reg.instances), "max_instances": reg.max_instances,
                      "num_tasks": reg.num_tasks, "reaped": reg.reaped})

    @app.get("/tasks")
    def tasks():
        return _json({"env": env_cls.name, "num_tasks": reg.num_tasks, "splits": env_cls.splits(world)})

    @app.post("/create")
    def create():
        return _json(op_create(body()))

    @app.post("/reset")
    def reset():
        return _json(op_reset(body()))

    @app.post("/step")
    def step():
        return _json(op_step(body()))

    @app.post("/close")
    def close():
        return _json(op_close(body()))

    @app.get("/observation")
    def observation():
        return _json(read(_query_id(), lambda inst: inst.env.observation()))

    @app.get("/available_actions")
    def available_actions():
        return _json(read(_query_id(), lambda inst: inst.env.available_actions()))

    @app.get("/detail")
    def detail():
        def fn(inst):
            return {**inst.env.detail(), "task": inst.task, "done": inst.done}
        return _json(read(_query_id(), fn))

    @app.get("/expert_action")
    def expert_action():
        return _json(read(_query_id(), lambda inst: inst.env.expert_action()))

    @app.post("/batch")
    def batch():
        items = body().get("ops")
        if not isinstance(items, list):
            raise ApiError(400, "field 'ops' must be a list of {\"op\": ..., ...} objects")
        if len(items) > max_batch_ops:
            raise ApiError(400, f"at most {max_batch_ops} ops per batch, got {len(items)}")

        def run_one(item):
            # One op's failure is its own result; the other ops of the batch still run.
            try:
                if not isinstance(item, dict) or item.get("op") not in ops:
                    raise ApiError(400, f"each op needs \"op\" in {sorted(ops)}")
                return ops[item["op"]](item)
            except ApiError as e:
                return {"error": e.message, "status": e.status}
            except TaskError as e:
                return {"error": str(e), "status": e.status}
            except Exception as e:
                log.exception("batch op %r failed", item.get("op"))
                return {"error": f"internal error: {type(e).__name__}: {e}", "status": 500}

        results = list(pool.map(run_one, items)) if pool else [run_one(x) for x in items]
        return _json({"results": results})

    # -- errors: always JSON, never a crash
    @app.errorhandler(ApiError)
    def on_api_error(e: ApiError):
        return _json({"error": e.message}, e.status)

    @app.errorhandler(TaskError)
    def on_task_error(e: TaskError):
        return _json({"error": str(e)}, e.status)

    @app.errorhandler(HTTPException)
    def on_http_error(e: HTTPException):
        return _json({"error": f"{e.name}: {e.description}"}, e.code or 500)

    @app.errorhandler(Exception)
    def on_bug(e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json({"error": f"internal error: {type(e).__name__}: {e}"}, 500)

    return app


# ---------------------------------------------------------------- serving
def make_server(app: Flask, host: str = "127.0.0.1", port: int = 0, threads: int = 4, **kw):
    """A waitress server (production-grade, threaded, pure Python) for `app`; `port=0` picks a free port
    (read it from `server.effective_port`). Call `.run()` to serve, `.close()` to stop.

    Tuned for many small JSON requests (measured with bench/env_throughput.py, +20% single-step
    steps/s): responses are buffered whole and sent by the I/O loop in one write (`send_bytes`) instead
    of one send per header and body from the worker thread; poll() instead of select(); and few worker
    threads, since game steps hold the GIL (raise --threads for games that wait on I/O or a JVM).
    """
    from waitress.server import create_server

    # waitress warns "Task queue depth is N" whenever requests wait for a thread: normal under load.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    opts = {"connection_limit": 2048, "channel_timeout": 300, "send_bytes": 1 << 16, "asyncore_use_poll": True,
            "ident": "env_server", **kw}
    with warnings.catch_warnings():  # waitress 3.0 marks send_bytes deprecated; requirements pin 3.0.2
        warnings.filterwarnings("ignore", message="send_bytes", category=DeprecationWarning)
        return create_server(app, host=host, port=port, threads=threads, **opts)


def serve_wsgi_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Serve any WSGI app with waitress on a daemon thread; return (base_url, stop)."""
    server = make_server(app, host, port)
    stopping, stopped = threading.Event(), threading.Event()

    def loop():
        # waitress's own run() cannot be stopped from another thread; poll in short slices instead and
        # close the server (and its open connections) from this thread once asked to stop.
        while not stopping.is_set():
            server.asyncore.loop(timeout=0.05, map=server._map, count=1)
        for channel in list(server._map.values()):
            channel.close()
        server.close()
        stopped.set()

    threading.Thread(target=loop, name="env-server", daemon=True).start()

    def stop():
        stopping.set()
        stopped.wait(5)

    return f"http://{host}:{server.effective_port}", stop


def serve_in_thread(env_cls: type[Env], world=None, host: str = "127.0.0.1", port: int = 0, **app_kw):
    """Start a server for `env_cls` on a daemon thread; return (base_url, stop). For tests and in-process use."""
    app = create_app(env_cls, world, **app_kw)
    url, stop_server = serve_wsgi_in_thread(app, host, port)

    def stop():
        stop_server()
        app.extensions["registry"].stop()

    return url, stop


class ServerProcess:
    """`python -m env_server NAME` in a child process, on a free port; `.url`, `.stop()`.

    Used by train.py when no `--env-addr` is given, and by tests and benches. A separate process keeps
    the env off the trainer's GIL.
    """

    def __init__(self, name: str, *args: str, host: str = "127.0.0.1", start_timeout_s: float = 60.0,
                 env: dict | None = None):

        cmd = [sys.executable, "-m", "env_server", name, "--host", host, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.stderr_tail: list[str] = []
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put("")],
                         daemon=True).start()
        # Keep the last lines of stderr for error messages; reading also keeps the pipe from filling.
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        try:
            line = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"env server {name!r} did not start within {start_timeout_s:g} s") from None
        if not line.startswith("serving "):
            self.proc.wait(10)
            raise RuntimeError(f"env server {name!r} exited with code {self.proc.returncode}:\n"
                               + "".join(self.stderr_tail[-30:]))
        self.url = line.split(" on ", 1)[1].strip()

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line])[-200:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
