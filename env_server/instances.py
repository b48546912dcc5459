"""The instances of one env server: the registry (ids, the cap, per-instance locks, the idle reaper,
idempotent creates) and the runner that plays each call into a game under a deadline that counts the
call's own time. env_server/app.py serves them over HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .base import Env

log = logging.getLogger("env_server")


class ApiError(Exception):
    """A request the server refuses; becomes `{"error": message}` with `status` (and a Retry-After
    header when `retry_after` seconds are given: the same request may succeed then)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class Instance:
    __slots__ = ("env", "key", "lock", "last_used", "task", "done", "closed", "hung")

    def __init__(self, env: Env, key: str | None = None):
        self.env, self.key = env, key  # key: the request_key of the create that made it
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        # the task id of the running episode, None before the first reset
        self.task: int | None = None
        self.done = False
        self.closed = False
        self.hung = False  # a call into the game ran past the deadline and still holds the lock


class Hung(Exception):
    """The result of a call that ran past the runner's deadline."""


class Runner:
    """Runs calls into games on worker threads, each call under a deadline.

    `run(calls, keys)` deals the calls out to `threads` slices played in parallel, each slice in
    the list's order on one thread (one slice: all in order, as GIL-bound games want). Calls with
    the same key (an instance id) go to the same slice, so they play in the list's order; calls
    without keys go in contiguous runs. Each call's result, or the exception it raised, comes back
    in place. A call still running `timeout_s` after it started gets a `Hung` result: its thread
    is left behind (Python cannot stop a thread), the rest of its slice goes on on a fresh one, and
    the caller marks the instance hung. The executor grows a new thread whenever none is idle.

    Only a call's own time counts: while it waits for another call (inside `waiting()`: the
    instance's lock, see Registry.hold) its deadline is off, and it starts afresh when the wait
    ends. Otherwise calls queued behind a slow but healthy one would be declared hung, and their
    instance with them.
    """

    def __init__(self, threads: int, timeout_s: float):
        self.threads, self.timeout_s = max(1, threads), timeout_s
        self.pool = ThreadPoolExecutor(4096, thread_name_prefix="env-call")
        self.lock = threading.Lock()
        self.abandoned = 0  # threads left behind in hung calls
        # .state: the progress of the slice this worker thread plays
        self._local = threading.local()

    @contextlib.contextmanager
    def waiting(self):
        """The calling call waits for another one: no deadline inside, its own time starts on
        leaving. Outside `run` (no slice on this thread) it does nothing."""
        state = getattr(self._local, "state", None)
        if state is None:
            yield
            return
        with self.lock:
            state[2] = None
        try:
            yield
        finally:
            with self.lock:
                state[2] = time.monotonic()

    def run(self, calls: list, keys: list | None = None) -> list:
        if not calls:
            return []
        results: list = [None] * len(calls)
        size = -(-len(calls) // self.threads)
        # a key's calls, keys in order of first call; a call without a key: its contiguous run
        groups: dict = {}
        for j, key in enumerate(keys or [None] * len(calls)):
            groups.setdefault(("run", j // size) if key is None else key, []).append(j)
        slices: list[list[int]] = [[] for _ in range(self.threads)]
        for group in groups.values():
            min(slices, key=len).extend(group)
        # future -> its slice's progress [position in it, its call indices (in order), start time
        # of the current call (None while it waits), abandoned]
        jobs = {}

        def play(state):
            self._local.state = state
            try:
                while True:
                    with self.lock:
                        if state[3] or state[0] >= len(state[1]):
                            return
                        j, state[2] = state[1][state[0]], time.monotonic()
                    try:
                        r = calls[j]()
                    except Exception as e:
                        r = e
                    with self.lock:
                        if state[3]:  # declared hung meanwhile: its result went out as Hung
                            return
                        results[j], state[0] = r, state[0] + 1
            finally:
                self._local.state = None

        def start(indices: list[int]):
            state = [0, indices, time.monotonic(), False]
            jobs[self.pool.submit(play, state)] = state

        for indices in slices:
            if indices:
                start(sorted(indices))
        while jobs:
            now = time.monotonic()
            with self.lock:  # calls that wait have no deadline yet: look again after a full timeout
                wait_s = min((max(0.0, s[2] + self.timeout_s - now) for s in jobs.values()
                              if s[2] is not None),
                             default=self.timeout_s)
            done, _ = wait(list(jobs), timeout=wait_s + 0.01, return_when=FIRST_COMPLETED)
            for f in done:
                del jobs[f]
            now = time.monotonic()
            for f, state in list(jobs.items()):
                with self.lock:
                    late = (not f.done() and state[0] < len(state[1]) and state[2] is not None
                            and now - state[2] > self.timeout_s)
                    if late:
                        state[3] = True
                        self.abandoned += 1
                if late:
                    del jobs[f]
                    rest = state[1][state[0]:]
                    results[rest[0]] = Hung(f"the game did not answer within {self.timeout_s:g} s "
                                            "(--op-timeout)")
                    if len(rest) > 1:
                        start(rest[1:])
        return results


class Registry:
    """Live instances, the id counter, the cap, the create request keys and the reaper.

    `lock_timeout_s` bounds how long a call waits for an instance another call is using (then: 503
    busy, retry later); `waiting` is the runner's `Runner.waiting`, so that such a wait is not
    counted against the call's deadline."""

    def __init__(self, env_cls: type[Env], world, max_instances: int, idle_timeout_s: float,
                 lock_timeout_s: float = 60.0, first_id: int | None = None,
                 waiting=contextlib.nullcontext):
        self.env_cls, self.world = env_cls, world
        self.lock_timeout_s, self.waiting = lock_timeout_s, waiting
        self.num_tasks = env_cls.num_tasks(world)
        self.max_instances, self.idle_timeout_s = max_instances, idle_timeout_s
        self.instances: dict[int, Instance] = {}
        # request_key -> id of the instance its create made, while it lives
        self.keys: dict[str, int] = {}
        # reserved ids whose env is being made; set when done
        self.building: dict[int, threading.Event] = {}
        # Ids count up from a random base and are never reused, so a stale id can't hit a new game,
        # not even one of the next server started on this port. The base comes from the OS, not the
        # process's `random`, which a trainer seeds: two servers started after the same seed would
        # otherwise draw the same base.
        self.first_id = self.next_id = (random.SystemRandom().randrange(1, 2000) * 1_000_000
                                        if first_id is None else first_id)
        self.lock = threading.Lock()
        self.reaped = 0
        self._stop = threading.Event()
        if idle_timeout_s > 0:
            threading.Thread(target=self._reap_loop, name="env-reaper", daemon=True).start()

    def create(self, key: str | None = None) -> tuple[int, bool]:
        """The id of a new instance, and True; with a `key`, that of the live instance a create with
        this key made, if any, and False: a client retrying a create whose answer it lost must not
        leave an orphan holding a slot."""
        while True:
            with self.lock:
                iid = self.keys.get(key) if key is not None else None
                if iid is None or (iid not in self.building and self.instances[iid].closed):
                    iid = self._reserve(key)
                    break
                built = self.building.get(iid)
                if built is None:
                    return iid, False
            # The first create with this key is still making its env: wait for it; if it failed, the
            # key is free again and the next round makes the instance.
            with self.waiting():
                if not built.wait(self.lock_timeout_s):
                    raise ApiError(503, "a create with this request_key has been making instance "
                                        f"{iid} for {self.lock_timeout_s:g} s; retry later",
                                   retry_after=1)
        try:
            inst = Instance(self.env_cls(self.world), key)
        except BaseException:
            with self.lock:
                del self.instances[iid]
                if key is not None:
                    del self.keys[key]
                self.building.pop(iid).set()
            raise
        with self.lock:
            self.instances[iid] = inst
            self.building.pop(iid).set()
        return iid, True

    def _reserve(self, key: str | None) -> int:
        """A new id with its slot (under self.lock): env construction may be slow (a JVM)."""
        if len(self.instances) >= self.max_instances:
            raise ApiError(503, f"server full: {len(self.instances)} live instances (cap "
                                f"--max-instances={self.max_instances}); close instances or raise "
                                "the cap")
        iid, self.next_id = self.next_id, self.next_id + 1
        self.instances[iid] = None
        self.building[iid] = threading.Event()
        if key is not None:
            self.keys[key] = iid
        return iid

    def _unlist(self, iid: int, inst: Instance) -> None:
        """Remove a closed instance, and its request key, from the lists (under self.lock)."""
        self.instances.pop(iid, None)
        if inst.key is not None and self.keys.get(inst.key) == iid:
            del self.keys[inst.key]

    def get(self, iid: int) -> Instance:
        inst = self.instances.get(iid)
        if inst is None or inst.closed:
            if self.first_id <= iid < self.next_id:
                raise ApiError(404, f"instance {iid} is closed (or was reaped after "
                                    f"{self.idle_timeout_s:g} s idle)")
            raise ApiError(404, f"unknown instance id {iid} (not created by this server)")
        if inst.hung:
            raise self._hung(iid)
        return inst

    @staticmethod
    def _hung(iid: int) -> ApiError:
        return ApiError(503, f"instance {iid} is hung: a call into its game ran past the deadline; "
                             "close it and create another")

    @contextlib.contextmanager
    def hold(self, iid: int, inst: Instance):
        """The instance's lock, for one call into its game. The call's deadline starts once it holds
        it (the wait is another call's time); waiting longer than `lock_timeout_s` behind healthy
        calls is a 503 busy with Retry-After, which leaves the instance as it is; behind a call
        declared hung, the instance's "hung" 503 as soon as it is marked."""
        give_up = time.monotonic() + self.lock_timeout_s
        with self.waiting():
            while not inst.lock.acquire(timeout=0.05):  # returns at once when the lock is freed
                if inst.hung:
                    raise self._hung(iid)
                if inst.closed:
                    raise ApiError(404, f"instance {iid} is closed")
                if time.monotonic() > give_up:
                    raise ApiError(503, f"instance {iid} is busy: other calls into its game have "
                                        f"held it for {self.lock_timeout_s:g} s; retry later",
                                   retry_after=1)
        try:
            if inst.closed:
                raise ApiError(404, f"instance {iid} is closed")
            inst.last_used = time.monotonic()
            yield inst
        finally:
            # idle time counts from the end of a call, however long
            inst.last_used = time.monotonic()
            inst.lock.release()

    def mark_hung(self, iid) -> None:
        inst = self.instances.get(iid) if isinstance(iid, int) else None
        if inst is not None and not inst.closed:
            inst.hung = True
            log.warning("instance %d is hung: a call into its game ran past the deadline", iid)

    def close(self, iid: int) -> None:
        inst = self.instances.get(iid)
        if inst is not None and inst.hung:  # its lock is held for good: close without it
            self._drop(iid, inst)
            return
        inst = self.get(iid)
        with self.hold(iid, inst):
            self._drop(iid, inst)

    def discard(self, iid: int) -> None:
        """Close the instance of a create that failed after making it (nobody knows its id), unless
        closed meanwhile; quietly, so that the create's own error is what its caller reads."""
        try:
            self.close(iid)
        except ApiError:
            pass
        except Exception:
            log.exception("closing instance %d failed", iid)

    def _drop(self, iid: int, inst: Instance) -> None:
        """Unlist and close an instance. A hung one is closed on a thread of its own: closing may be
        what frees its stuck call (a JVM killed), or may hang as well."""
        inst.closed = True
        with self.lock:
            self._unlist(iid, inst)
        if inst.hung:
            threading.Thread(target=self._close_quietly, args=(iid, inst), daemon=True).start()
        else:
            inst.env.close()

    @staticmethod
    def _close_quietly(iid: int, inst: Instance) -> None:
        try:
            inst.env.abandon() if inst.hung else inst.env.close()
        except Exception:
            log.exception("closing instance %d failed", iid)

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
            # abandoned by its client after the deadline; its lock is never coming back
            if inst.hung:
                if not inst.closed:
                    self._drop(iid, inst)
                    n += 1
                continue
            if not inst.lock.acquire(blocking=False):
                continue  # busy right now, so not idle
            try:
                if inst.closed or time.monotonic() - inst.last_used <= self.idle_timeout_s:
                    continue
                inst.closed = True
                with self.lock:
                    self._unlist(iid, inst)
                self._close_quietly(iid, inst)
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
            self.keys.clear()
        for inst in live:
            try:
                inst.env.abandon() if inst.hung else inst.env.close()
            except Exception:
                log.exception("closing instance at shutdown failed")
