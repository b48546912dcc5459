"""One generic Flask app for every environment, speaking the AgentGym HTTP protocol.

    POST /create {"data_idx"?, "request_key"?} -> {"id", "observation", "reward", "done"}
    POST /reset  {"id", "data_idx"}      -> {"id", "observation", "reward", "score", "done"} (+ the
                                            game's own, e.g. SciWorld's "task_description")
    POST /step   {"id", "action"}        -> {"observation", "reward", "score", "done", "info"}
    GET  /observation?id=                -> "text"
    GET  /available_actions?id=          -> ["...", ...]
    GET  /detail?id=                     -> {...}
    POST /close  {"id"}                  -> true
    POST /batch  {"ops": [{"op": "step"|"reset"|"create"|"close", ...}]} -> {"results": [...]}
    GET  /expert_action?id=              -> "the expert's next action" (tests, warm starts; not
                                            AgentGym)
    GET  /tasks                          -> {"num_tasks", "splits"}
    GET  /                               -> health

AgentGym's clients read these shapes, so they drive this server unchanged. A body or query may name
the instance `env_idx` instead of `id` (AgentGym's SearchQA and WebArena servers do); where it does,
`env_idx` is the instance and `id`, if any, is the task. An env whose class sets `bare_answers`
(SearchQA) also speaks AgentGym's SearchQA dialect, whose answers are bare values:

    POST /create {"id": task} (or no body)  -> instance id   (the instance starts on that task)
    POST /reset  {"env_idx", "id": task}    -> "observation"  (any /reset naming `env_idx`)

while a /create with any other body (this project's client's `{"request_key"}`, `{}`) and a /reset
naming `id` answer the objects above, and /batch always does. Unlike AgentGym, a caller's mistake is
a 4xx with `{"error": ...}` (never HTTP 200), and a server bug is a logged 500: the server never
dies. A create that carries a `request_key` (a string of the client's choosing, at most 200
characters) answers the same id for the same key while that instance lives: a client that retries a
create whose answer it lost gets the instance it made, not a second one holding a slot until the
reaper comes. For the same reason a create with a task whose reset fails closes the instance it
made (one whose reset hangs answers a 504 naming it).

Instances live in an `instances.Registry`: each has its own lock, so that two requests for the same
instance never interleave while requests for different instances run in parallel; idle instances are
reaped and live ones capped. Every call into a game runs under a deadline (`op_timeout_s`, see
`instances.Runner`): a hung game costs its own instance, never a server thread or the other
instances. Instance ids start at a random base, so that a client of a server that was restarted gets
a 404 for its old ids instead of driving someone else's game.

There is no authentication: `guard` refuses what a web page in the user's browser could send (simple
cross-site POSTs, foreign origins, DNS rebinding while bound to loopback).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import threading
import time
import warnings
from urllib.parse import urlsplit

from flask import Flask, Response, request
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, create_server
from waitress.task import ErrorTask
from werkzeug.exceptions import HTTPException

from .base import Env, TaskError
from .instances import ApiError, Hung, Registry, Runner

log = logging.getLogger("env_server")


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
    try:
        v.encode("utf-8")
    # JSON can carry "\ud800"; a game's JVM or browser cannot take it
    except UnicodeEncodeError as e:
        raise ApiError(400, f"field {name!r} is not valid Unicode: lone surrogate at "
                            f"{e.start}") from None
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


# ---------------------------------------------------------------- who may call
def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without a port) is this machine's loopback
    interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_port(netloc: str, default_port: int | None = None) -> tuple[str, int | None]:
    """("host", port) of "host:port"; raises ValueError when it is not one."""
    u = urlsplit("//" + netloc)
    if not u.hostname:
        raise ValueError(f"no host in {netloc!r}")
    return u.hostname, u.port or default_port


def guard(app: Flask, host: str = "127.0.0.1") -> Flask:
    """Refuse what a web page open in the user's browser could send: the servers and the viewer have
    no authentication, and a browser sends a page's requests to any address, 127.0.0.1 included.

    - A POST with a body that is not `Content-Type: application/json`: 415. A page may POST
      text/plain, forms or no type at all to any address without the browser asking first; a JSON
      POST needs a CORS preflight that these servers never grant. A POST with no body at all passes
      (AgentGym's BabyAI, SciWorld and SearchQA clients create instances so): a browser sends it
      with an Origin, which the next rule checks, and the Host rule stops DNS rebinding.
    - A foreign `Origin` (one whose host:port is not the request's own Host): 403. Clients that are
      not browsers (curl, Python) send no Origin.
    - While bound to loopback, a Host that is not a loopback name or address: 403. DNS rebinding (a
      page's own name resolving to 127.0.0.1) passes the Origin check; the Host it sends gives it
      away. Bound to another address (`--host`), any Host is accepted: whoever reaches the port may
      call.

    `host` is the bound address; make_server sets it to the one it binds (app.config["BIND_HOST"]).
    """
    app.config["BIND_HOST"] = host

    @app.before_request
    def refuse_cross_site():
        # absent only from HTTP/1.0 clients; browsers send it
        sent = request.environ.get("HTTP_HOST")
        if sent is not None and is_loopback(app.config["BIND_HOST"]):
            try:
                ok = is_loopback(_host_port(sent)[0])
            except ValueError:
                ok = False
            if not ok:
                return _json({"error": f"Host {sent[:100]!r} refused: a server bound to "
                                       f"{app.config['BIND_HOST']} answers only to loopback names"},
                             403)
        origin = request.headers.get("Origin")
        if origin is not None:
            try:
                o = urlsplit(origin)
                default = {"http": 80, "https": 443}.get(o.scheme)
                same = default is not None and sent is not None and \
                    (o.hostname, o.port or default) == _host_port(sent, default)
            except ValueError:
                same = False
            if not same:
                return _json({"error": f"Origin {origin[:100]!r} refused: requests from other "
                                       "sites' pages are not served"}, 403)
        bodyless = not request.content_length and "Transfer-Encoding" not in request.headers
        if request.method == "POST" and request.mimetype != "application/json" and not bodyless:
            return _json({"error": f"POST needs Content-Type: application/json, got "
                                   f"{request.content_type or 'none'!r}"[:200]}, 415)
        return None

    return app


# ---------------------------------------------------------------- the app
def create_app(env_cls: type[Env], world=None, *, max_instances: int = 1024,
               idle_timeout_s: float = 900.0, op_timeout_s: float = 60.0,
               max_body_bytes: int = 1 << 20, max_batch_ops: int = 4096,
               first_id: int | None = None, host: str = "127.0.0.1") -> Flask:
    """Build the Flask app serving `env_cls`. `world` defaults to `env_cls.load_world()`; `first_id`
    pins the first instance id (tests), else it is random; `host` is the address it will be bound to
    (`guard`; make_server sets it)."""
    if world is None:
        world = env_cls.load_world(None)
    # Games that wait on I/O or a JVM set batch_threads > 1 to play a batch's ops in parallel.
    runner = Runner(getattr(env_cls, "batch_threads", 1), op_timeout_s)
    # A call waits for a busy instance up to one op timeout: as long as the call it waits for may
    # take.
    reg = Registry(env_cls, world, max_instances, idle_timeout_s, lock_timeout_s=op_timeout_s,
                   first_id=first_id, waiting=runner.waiting)
    app = guard(Flask(f"env_server.{env_cls.name}"), host)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes  # werkzeug answers 413 past this
    app.extensions["registry"] = reg
    app.extensions["runner"] = runner

    def body() -> dict:
        try:
            data = json.loads(request.get_data(cache=False) or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:  # brackets nested past Python's recursion limit: "[" * 100000
            raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    bare = env_cls.bare_answers

    def task_id(b: dict, with_id: bool) -> int:
        """The task a body names: `data_idx` or `idx`, else (`with_id`: `id` is not the instance)
        `id`."""
        idx = _int(b, "data_idx", "idx", *(("id",) if with_id else ()))
        if not 0 <= idx < reg.num_tasks:
            raise ApiError(400, f"task id {idx} out of range: {env_cls.name} has tasks "
                                f"0..{reg.num_tasks - 1}")
        return idx

    def instance_id(b: dict) -> int:
        return _int(b, "env_idx") if "env_idx" in b else _int(b, "id")

    created = object()  # a body's key no JSON can hold: the instance a create made

    def named_instance(b, create: bool = False) -> object:
        """The instance a call names, if any, unchecked (to mark it hung); a create's, the one it
        made (its reset, with a task given, may hang)."""
        if not isinstance(b, dict):
            return None
        if create or b.get("op") == "create":
            return b.get(created)
        return b.get("env_idx", b.get("id"))

    # -- operations shared by the single endpoints and /batch; each returns a JSON-able value
    def op_create(b: dict) -> dict:
        # AgentGym SearchQA's {"id": task}
        given = "data_idx" in b or "idx" in b or (bare and "id" in b)
        idx = task_id(b, with_id=bare) if given else None
        key = _str(b, "request_key", max_len=200) if "request_key" in b else None
        # with a key seen before: that instance (reset again when a task is given)
        iid, made = reg.create(key)
        b[created] = iid
        out = {"id": iid, "observation": "", "reward": 0, "done": False}
        if idx is not None:
            try:
                out = op_reset({"id": iid, "data_idx": idx})
            except Exception:
                if made:  # its caller gets no id
                    reg.discard(iid)
                raise
        return out

    def op_reset(b: dict) -> dict:
        # AgentGym SearchQA's {"env_idx", "id": task}
        iid, idx = instance_id(b), task_id(b, with_id="env_idx" in b)
        inst = reg.get(iid)
        with reg.hold(iid, inst):
            obs = inst.env.reset(idx)
            inst.task, inst.done = idx, False
            fields = inst.env.reset_fields()
        return {"id": iid, "observation": obs, "reward": 0, "score": 0, "done": False, **fields}

    def op_step(b: dict) -> dict:
        iid, action = instance_id(b), _str(b, "action")
        inst = reg.get(iid)
        with reg.hold(iid, inst):
            if inst.task is None:
                raise ApiError(409, f"instance {iid} has no task yet: call /reset first")
            if inst.done:
                raise ApiError(409, f"the episode of instance {iid} is over: call /reset to start "
                                    "another")
            r = inst.env.step(action)
            inst.done = bool(r.done)
        score = r.reward if r.score is None else r.score
        return {"observation": r.observation, "reward": r.reward, "score": score,
                "done": bool(r.done), "info": r.info}

    def op_close(b: dict) -> bool:
        reg.close(instance_id(b))
        return True

    ops = {"create": op_create, "reset": op_reset, "step": op_step, "close": op_close}

    def settle(iid, r):
        """A runner result as the answer: a hung call marks its instance and is a 504."""
        if isinstance(r, Hung):
            reg.mark_hung(iid)
            raise ApiError(504, f"instance {iid}: {r}; the instance takes no more calls, close it")
        if isinstance(r, Exception):
            raise r
        return r

    def guarded(b: dict, op):  # one op, on a runner thread, under the deadline
        r = runner.run([lambda: op(b)])[0]
        return settle(named_instance(b, create=op is op_create), r)

    def read(iid: int, fn, needs_task: bool = True):
        def call():
            inst = reg.get(iid)
            with reg.hold(iid, inst):
                if needs_task and inst.task is None:  # a game has no state before its first reset
                    raise ApiError(409, f"instance {iid} has no task yet: call /reset first")
                return fn(inst)
        return settle(iid, runner.run([call])[0])

    # -- routes
    @app.get("/")
    def health():
        return _json({"status": "ok", "env": env_cls.name, "protocol": "agentgym", "batch": True,
                      "instances": len(reg.instances), "max_instances": reg.max_instances,
                      "num_tasks": reg.num_tasks, "reaped": reg.reaped})

    @app.get("/tasks")
    def tasks():
        return _json({"env": env_cls.name, "num_tasks": reg.num_tasks,
                      "splits": env_cls.splits(world)})

    @app.post("/create")
    def create():
        bodyless = not request.get_data(cache=True)
        b = body()
        out = guarded(b, op_create)
        # AgentGym SearchQA's: bare
        return _json(out["id"] if bare and (bodyless or "id" in b) else out)

    @app.post("/reset")
    def reset():
        b = body()
        out = guarded(b, op_reset)
        # AgentGym SearchQA's: bare
        return _json(out["observation"] if bare and "env_idx" in b else out)

    @app.post("/step")
    def step():
        return _json(guarded(body(), op_step))

    @app.post("/close")
    def close():
        return _json(guarded(body(), op_close))

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
        return _json(read(_query_id(), fn, needs_task=False))  # (a SciWorld instance: no JVM yet)

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
                if (not isinstance(item, dict) or not isinstance(item.get("op"), str)
                        or item["op"] not in ops):
                    raise ApiError(400, f"each op needs \"op\" in {sorted(ops)}")
                return ops[item["op"]](item)
            except ApiError as e:
                return {"error": e.message, "status": e.status}
            except TaskError as e:
                return {"error": str(e), "status": e.status}
            except Exception as e:
                log.exception("batch op %r failed", item.get("op"))
                return {"error": f"internal error: {type(e).__name__}: {e}", "status": 500}

        # one instance's ops play in the batch's order, other instances' beside them
        keys = [named_instance(x) for x in items]
        results = runner.run([lambda x=x: run_one(x) for x in items],
                             [k if isinstance(k, int) else None for k in keys])
        for item, r in zip(items, results):
            if isinstance(r, Hung):
                reg.mark_hung(named_instance(item))
        return _json({"results": [{"error": str(r), "status": 504} if isinstance(r, Hung) else r
                                  for r in results]})

    # -- errors: always JSON, never a crash
    @app.errorhandler(ApiError)
    def on_api_error(e: ApiError):
        out = _json({"error": e.message}, e.status)
        if e.retry_after is not None:
            out.headers["Retry-After"] = str(e.retry_after)
        return out

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
class JsonErrorTask(ErrorTask):
    """The answers waitress gives itself, without asking the app (a body past max_request_body_size,
    a request it cannot parse, headers too large, a Transfer-Encoding it does not know, an app that
    raised before answering), as `{"error": ...}` like the app's, instead of plain text."""

    def execute(self):
        e = self.request.error
        body = json.dumps({"error": f"{e.reason}: {e.body}"}).encode()
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):
    """waitress's channel, with JSON error answers and the time its unfinished request began:
    from the connection's opening, then from each new request's first byte (None while no request
    is partly read). waitress's idle rule alone cannot end a connection that sends one byte of a
    header every few seconds; `close_slow_requests` ends one whose request takes too long."""

    error_task_class = JsonErrorTask

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.request_began = self.creation_time

    def received(self, data):
        before = self.request
        if before is None and self.request_began is None:
            self.request_began = time.time()
        out = super().received(data)
        if self.request is None:
            self.request_began = None
        elif self.request is not before and before is not None:  # a pipelined request began
            self.request_began = time.time()
        return out


def close_slow_requests(server, deadline_s: float, now: float) -> None:
    """waitress's maintenance (idle connections), then: close each connection whose request has
    not arrived whole `deadline_s` after it began (a connection that sends nothing counts from its
    opening)."""
    type(server).maintenance(server, now)
    for channel in list(server.active_channels.values()):
        began = getattr(channel, "request_began", None)
        if began is not None and now - began > deadline_s and not channel.requests:
            channel.will_close = True


def make_server(app: Flask, host: str = "127.0.0.1", port: int = 0, threads: int = 4,
                request_deadline_s: float = 10.0, **kw):
    """A waitress server (production-grade, threaded, pure Python) for `app`; `port=0` picks a free
    port (read it from `server.effective_port`). Call `.run()` to serve, `.close()` to stop. A
    guarded app (`guard`) learns here the address it is bound to; waitress's own error answers are
    JSON too.

    Tuned for many small JSON requests (measured with bench/env_throughput.py, +20% single-step
    steps/s): responses are buffered whole and sent by the I/O loop in one write (`send_bytes`)
    instead of one send per header and body from the worker thread; poll() instead of select(); and
    few worker threads, since game steps hold the GIL (raise --threads for games that wait on I/O or
    a JVM). A request must arrive whole within `request_deadline_s` of its first byte (a new
    connection's first within as long of its opening), or its connection is closed: otherwise a
    client trickling a header line holds a connection for as long as it likes, and enough of them
    hold every connection the server allows (docs/reliability.md).
    """
    # waitress warns "Task queue depth is N" whenever requests wait for a thread: normal under load.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    # An idle connection is closed after 30 s (checked every 5 s; a request being served is never
    # idle): 2,048 idle connections, the limit, held new clients off for 300 s at waitress's own
    # settings. Clients reconnect: env_client drops a kept connection after 1 s unused anyway.
    opts = {"connection_limit": 2048, "channel_timeout": 30, "cleanup_interval": 5,
            "send_bytes": 1 << 16, "asyncore_use_poll": True, "ident": "env_server", **kw}
    config = getattr(app, "config", {})
    # a guarded app: its Host rule follows the address bound here, whatever it was told
    if "BIND_HOST" in config:
        config["BIND_HOST"] = host
    cap = config.get("MAX_CONTENT_LENGTH")
    # waitress would buffer up to 1 GB for Flask's 413; far past the cap it refuses (JsonErrorTask)
    if cap:
        opts.setdefault("max_request_body_size", 16 * cap)
    # waitress's socket map: the listening socket(s), a wake-up pipe, then connections
    sockets: dict = {}
    # waitress 3.0 marks send_bytes deprecated; requirements pin 3.0.2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="send_bytes", category=DeprecationWarning)
        server = create_server(app, host=host, port=port, threads=threads, map=sockets, **opts)
    for listener in sockets.values():
        # makes a channel per connection: ours, for this server only
        if isinstance(listener, BaseWSGIServer):
            listener.channel_class = JsonErrorChannel
            listener.maintenance = functools.partial(close_slow_requests, listener,
                                                     request_deadline_s)
    return server


def serve_wsgi_in_thread(app, host: str = "127.0.0.1", port: int = 0, **kw):
    """Serve any WSGI app with waitress on a daemon thread (make_server's `kw`); return (base_url,
    stop)."""
    server = make_server(app, host, port, **kw)
    stopping, stopped = threading.Event(), threading.Event()

    def loop():
        # waitress's own run() cannot be stopped from another thread; poll in short slices instead
        # and close the server (and its open connections) from this thread once asked to stop.
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


def serve_in_thread(env_cls: type[Env], world=None, host: str = "127.0.0.1", port: int = 0,
                    **app_kw):
    """Start a server for `env_cls` on a daemon thread; return (base_url, stop). For tests and
    in-process use."""
    app = create_app(env_cls, world, host=host, **app_kw)
    url, stop_server = serve_wsgi_in_thread(app, host, port)

    def stop():
        stop_server()
        app.extensions["registry"].stop()

    return url, stop


# The child-process launcher lives in process.py (no Flask there); imported here for existing
# callers.
from .process import ServerProcess, serving  # noqa: E402,F401
