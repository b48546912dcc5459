"""SciWorld: ScienceWorld's elementary-science tasks, played on the `scienceworld` package's
simulator.

Follows AgentGym's agentenv-sciworld, the SciWorld server AgentGym-RL trains on:
- the games are the package's task types in its order (1-1 boil ... 10-2), every variation of each,
  except the seven types upstream leaves out (5-1/5-2 grow plant/fruit, 9-1..9-3 inclined planes,
  10-1/10-2 Mendelian genetics): 23 types, 4,639 (task, variation) games; task id = position in that
  list;
- reset loads (task, variation) and plays "look around"; /reset answers as upstream's: `task_name`,
  `var_num`, `task_description`, `observation` (the look-around text alone), `reward`, `score`,
  `deleted`, `done`. The agent's first observation is the task description, a newline, then the
  look-around text: AgentGym's client joins them so, and env_client likewise;
- actions go to the simulator as typed (it answers "No known action matches that input." itself);
- done when the task is completed, when the score turns negative (a fatal mistake, such as focusing
  on the wrong object) or after more than 100 simulated moves (the package's own step limit).

Score and reward, on upstream's scale and with upstream's meaning (its /step answers the package's
`info["score"]` and `reward`):
- `score`: the episode's score so far, an integer 0-100 (100 = task completed; the package's
  sub-goals give partial credit), or negative after a fatal mistake (-100 as the package scores it).
  AgentGym's SciWorld client reads `score` as the reward of the step;
- `reward`: the change of `score` in this step, an integer (a fatal mistake after partial credit
  gives less than -100);
- /detail's `score` is the same 0-100 score; /reset answers `score` 0 and `reward` 0 (see the
  departures).
The trainer wants 0-1 (success = 1, as every other game): rollout.SCORE_SCALES holds SciWorld's
100, and the rollout (rollout.play_moves) divides the score it reads by it, from this server or
upstream's alike. Nothing here divides.

Departures from upstream:
- The game list is shipped (data/sciworld_splits.json, written from the package by
  `python -m env_server.sciworld --write-splits`) instead of being read from a JVM at every /create
  (where upstream appends it again each time), so ids are known without a JVM and are the same
  everywhere. Splits are the package's own train/dev/test variations of each task type.
- A step calls the simulator directly, not `ScienceWorldEnv.step`, which also computes the
  look-around, inventory and every valid action after each step (~200 ms of a ~210 ms step) for
  upstream to drop.
- Besides the simulated-move limit, an episode ends after 100 steps: free actions (look around,
  inventory, task, anything unrecognised) take no simulated time, so without it an episode could run
  forever.
- A step after done, or before reset, is an error (409) [upstream: an error string with HTTP 200].
- /reset answers `score` 0 and `reward` 0, as for every game [upstream: the score after "look
  around", which is 0 but in some chemistry-mix-paint variations (7, 13 or 20 there)]; the first
  step's `score` is the whole score, and its `reward` the change from the score after reset, as
  upstream.
The simulator itself is not exactly reproducible: two loads of one game can list objects in another
order or read temperatures a degree apart. A task id always means the same game (the same objects).

Expert: the package's gold action sequence for the game, generated on the first `expert_action` of
an episode (generating it makes a load ~10x slower, 0.5 s on average and up to several seconds, so
resets that never ask skip it). That reloads the game with the gold path and replays the episode's
actions, so the state is the one played up to the noise above. Gold paths also differ between loads
(which of two plants, the order of opening cupboards), so one is generated per episode and kept. The
expert answers the first gold action the agent has not taken yet, as long as the agent has followed
the gold path: actions that take no simulated time (unknown commands, look around, inventory, task)
are ignored; after any other action off the path, the gold path no longer applies and the expert
answers None.

JVMs: every instance runs its own simulator JVM, started on its first reset (~2 s) and reused by
later resets, and shut down by close() (a JVM still starting then, in a reset past its deadline,
as soon as it is up). A process runs at most --max-jvms of them (a reset past that is a 503) with a
heap of at most --jvm-heap-mb each. A JVM that dies (killed, crashed: py4j loses its connection)
turns into a 503 for its own instance only; the next reset of that instance starts a new JVM.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from .base import Env, StepResult, TaskError


def java_problem() -> str | None:
    """Why SciWorld cannot start its JVMs here, in one line (no `java` on the PATH), or None."""
    import shutil

    if shutil.which("java") is None:
        return ("SciWorld runs ScienceWorld in a JVM and needs Java 17 on the PATH; `java` is not "
                "there (Debian/Ubuntu: apt-get install openjdk-17-jre-headless)")
    return None

SPLITS_PATH = Path(__file__).parent / "data" / "sciworld_splits.json"
# as agentenv-sciworld's `exceptions`
EXCLUDED_TYPES = ("5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2")
MAX_STEPS = 100  # upstream's step limit (the package's envStepLimit default)
# the JVM default (a quarter of RAM) lets each grow past 1.5 GB on gold paths
DEFAULT_JVM_HEAP_MB = 512
JVM_OVERHEAD_MB = 256  # a JVM's memory beyond its heap (code, metaspace, threads), roughly
LOOK_AROUND = "look around"  # what reset plays, as upstream; it takes no simulated time
_USER_JAVA_OPTIONS = os.environ.get("JAVA_TOOL_OPTIONS", "")

# The package logs every load at INFO, and py4j logs each of its dozens of failed connections to a
# dead JVM with a traceback at ERROR; _game reports a lost JVM once, as a 503 and a warning.
logging.getLogger("scienceworld").setLevel(logging.WARNING)
logging.getLogger("py4j").setLevel(logging.CRITICAL)
log = logging.getLogger("env_server.sciworld")


@dataclass(frozen=True)
class World:
    games: tuple[tuple[str, int], ...]  # task id -> (task type name, variation)
    codes: dict[str, str]  # task type name -> the paper's number, e.g. "boil" -> "1-1"
    splits: dict[str, list[int]]  # "train" / "dev" / "test" -> task ids
    max_jvms: int
    jvm_heap_mb: int


def default_max_jvms(heap_mb: int) -> int:
    """As many JVMs as fit in this machine's memory at their largest, at most 128 (upstream trains
    16 tasks x 8 samples at once): past the cap a reset is a clear 503 rather than an out-of-memory
    kill."""
    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return max(1, min(128, ram_mb // (heap_mb + JVM_OVERHEAD_MB)))


def build_world(table: dict, max_jvms: int, jvm_heap_mb: int) -> World:
    """Games and splits from the shipped table: each task type's variations in order, ids counting
    up."""
    games, codes, splits = [], {}, {"train": [], "dev": [], "test": []}
    for t in table["task_types"]:
        split_of = {v: split for split in splits for v in t[split]}
        if sorted(split_of) != list(range(sum(len(t[split]) for split in splits))):
            raise ValueError(f"{SPLITS_PATH}: the variations of {t['name']} are not 0..n-1 split "
                             "once each")
        codes[t["name"]] = t["code"]
        for variation in range(len(split_of)):
            splits[split_of[variation]].append(len(games))
            games.append((t["name"], variation))
    return World(tuple(games), codes, splits, max_jvms, jvm_heap_mb)


def same_action(a: str, b: str) -> bool:
    """Equal up to case and spacing (the simulator reads both the same)."""
    return a.lower().split() == b.lower().split()


class SciWorldEnv(Env):
    name = "sciworld"
    batch_threads = 16  # /batch ops wait on their JVMs, not on the GIL: run them side by side

    # JVMs alive in this process, every instance together; the cap is the world's max_jvms.
    _jvms_alive = 0
    _jvms_lock = threading.Lock()

    # ---- world: the game list and the package's splits ----
    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--max-jvms", type=int, default=None,
                            help="simulator JVMs this server may run at once, one per instance "
                                 "that has been reset (a reset past it is a 503); default: as many "
                                 "as fit in RAM at heap + 256 MB each, at most 128")
        parser.add_argument("--jvm-heap-mb", type=int, default=DEFAULT_JVM_HEAP_MB,
                            help="largest Java heap of each JVM, in MB")

    @classmethod
    def load_world(cls, args: argparse.Namespace | None = None) -> World:
        if problem := java_problem():
            raise ValueError(problem)
        heap_mb = getattr(args, "jvm_heap_mb", DEFAULT_JVM_HEAP_MB)
        max_jvms = getattr(args, "max_jvms", None)
        if max_jvms is None:
            max_jvms = default_max_jvms(heap_mb)
        if max_jvms < 1 or heap_mb < 64:
            raise ValueError(f"--max-jvms must be at least 1 and --jvm-heap-mb at least 64, "
                             f"got {max_jvms} and {heap_mb}")
        return build_world(json.loads(SPLITS_PATH.read_text()), max_jvms, heap_mb)

    @classmethod
    def num_tasks(cls, world: World) -> int:
        return len(world.games)

    @classmethod
    def task_category(cls, world: World, idx: int) -> str:
        return world.games[idx][0]

    # ---- one instance ----
    def __init__(self, world: World):
        super().__init__(world)
        self._sw = None  # the package's ScienceWorldEnv: one JVM, started on the first reset
        self.idx: int | None = None
        # _sw and _closed change under it: a call past its deadline may still be starting or
        # stopping the JVM while close/abandon runs on another thread
        self._jvm_lock = threading.Lock()
        self._closed = False

    def _start_jvm(self) -> None:
        with SciWorldEnv._jvms_lock:
            if SciWorldEnv._jvms_alive >= self.world.max_jvms:
                raise TaskError(f"all {self.world.max_jvms} ScienceWorld JVMs of this server are "
                                "in use (--max-jvms): close other instances or raise the cap", 503)
            SciWorldEnv._jvms_alive += 1
            # The package starts java without options, so the heap cap goes through the environment;
            # written under the lock and only when it changes, since other threads may be starting
            # JVMs.
            options = f"{_USER_JAVA_OPTIONS} -Xmx{self.world.jvm_heap_mb}m".strip()
            if os.environ.get("JAVA_TOOL_OPTIONS") != options:
                os.environ["JAVA_TOOL_OPTIONS"] = options
        try:
            from scienceworld import ScienceWorldEnv
            sw = ScienceWorldEnv()
            # py4j tells the JVM when a Python proxy of a Java object dies, from whichever thread
            # Python's collector happens to run in: with this JVM frozen, that call would block an
            # unrelated request of another instance forever. So the garbage of the start-up is
            # collected now, while the JVM answers, and later proxies are not tracked: the few Java
            # objects a game hands back (action lists) are released with the JVM, when the instance
            # closes.
            sw._gateway._gateway_client.gateway_property.enable_memory_management = False
            gc.collect()
        except Exception as e:
            self._release_jvm_slot()
            raise TaskError(f"could not start a ScienceWorld JVM: {type(e).__name__}: {e}",
                            503) from e
        with self._jvm_lock:
            if not self._closed:
                self._sw = sw
                return
        # closed while the JVM started (a reset past its deadline): nobody else will stop it
        self._shut_down(sw)
        raise TaskError("this instance was closed while its ScienceWorld JVM started", 409)

    def _release_jvm_slot(self) -> None:
        with SciWorldEnv._jvms_lock:
            SciWorldEnv._jvms_alive -= 1

    def _stop_jvm(self, closing: bool = False) -> None:
        """Shut the JVM down, if any, and give its slot back; `closing`: for good, so that a JVM
        still starting is stopped as soon as it is up."""
        with self._jvm_lock:
            sw, self._sw = self._sw, None
            self._closed = self._closed or closing
        if sw is not None:
            self._shut_down(sw)

    def _shut_down(self, sw) -> None:
        """Shut a JVM down (killing it if it does not exit) and give its slot back."""
        proc = sw._gateway.java_process
        try:
            sw.close()
        # a dead JVM's gateway can fail to shut down: the kill below settles it
        except Exception as e:
            log.warning("ScienceWorld gateway shutdown failed: %s: %s", type(e).__name__, e)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._release_jvm_slot()

    def _game(self, fn, *args):
        """fn(*args) on the JVM. A lost JVM (killed, crashed, connection gone) is stopped and
        becomes a 503 for this instance; an exception thrown inside the simulator passes on (a game
        bug: HTTP 500)."""
        from py4j.protocol import Py4JError, Py4JJavaError

        try:
            return fn(*args)
        except Py4JJavaError:
            raise  # the JVM answered: it is alive
        except Py4JError as e:
            pid = self._jvm_pid()
            log.warning("ScienceWorld JVM pid %s lost: %s: %s", pid, type(e).__name__, e)
            self._stop_jvm()
            raise TaskError(f"the ScienceWorld JVM (pid {pid}) of this instance is gone ({e}); "
                            "reset to start a new one", 503) from e

    def _require_task(self) -> None:
        if self.idx is None:
            raise TaskError("no task yet: call reset first", 409)

    def _require_jvm(self) -> None:
        if self._sw is None:  # after a reset there is one: the JVM died during this episode
            raise TaskError("the ScienceWorld JVM of this instance died during this episode: "
                            "reset to start a new one", 503)

    def reset(self, idx: int) -> str:
        n = self.num_tasks(self.world)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            raise TaskError(f"data_idx must be an integer in [0, {n}), got {idx!r}", 404)
        if self._sw is None:
            self._start_jvm()
        task, variation = self.world.games[idx]
        self._game(self._sw.load, task, variation, "")
        server = self._sw.server
        description = self._game(server.getTaskDescription)
        look = self._game(server.step, LOOK_AROUND)
        self.idx, self.task, self.variation, self.description = idx, task, variation, description
        self._score100 = round(100 * self._game(server.getScore))  # as the package: an int, 0-100
        self._moves = self._game(server.getNumMoves)
        self._steps, self._done, self._completed = 0, False, False
        self._history: list[tuple[str, bool]] = []  # (action, whether it took simulated time)
        self._gold: list[str] | None = None  # generated on demand, see expert_action
        self._last_observation = look  # as upstream's /observation; the task is in reset_fields
        return look

    def reset_fields(self) -> dict:
        return {"task_name": self.task, "var_num": self.variation,
                "task_description": self.description, "deleted": False}

    def step(self, action: str) -> StepResult:
        self._require_task()
        if self._done:
            raise TaskError("the episode is over: call reset to start another", 409)
        if not isinstance(action, str):
            raise TaskError(f"action must be a string, got {type(action).__name__}")
        try:
            action.encode("utf-8")
        except UnicodeEncodeError:  # py4j cannot send it and would take the JVM for lost (a 503)
            raise TaskError("action is not valid Unicode: it has a lone surrogate") from None
        self._require_jvm()
        server = self._sw.server
        observation = self._game(server.step, action)
        score100 = round(100 * self._game(server.getScore))
        completed = bool(self._game(server.getCompleted))
        moves = self._game(server.getNumMoves)
        self._history.append((action, moves != self._moves))
        reward = score100 - self._score100  # as the package: the step's change of the 0-100 score
        self._score100, self._moves, self._completed = score100, moves, completed
        self._steps += 1
        self._done = completed or score100 < 0 or moves > MAX_STEPS or self._steps >= MAX_STEPS
        self._last_observation = observation
        return StepResult(observation, reward, self._done, score100,
                          {"moves": moves, "completed": completed})

    # ---- what the agent reads ----
    def observation(self) -> str:
        """The latest observation (the first one right after reset), as upstream's /observation."""
        self._require_task()
        return self._last_observation

    def available_actions(self) -> list[str]:
        """The simulator's action templates ("open OBJ", "move OBJ to OBJ", ...): the concrete valid
        actions number in the hundreds to thousands and take ~150 ms to list."""
        self._require_task()
        self._require_jvm()
        return list(self._game(self._sw.get_possible_actions))

    def detail(self) -> dict:
        if self.idx is None:
            return {"task_id": None, "done": False, "jvm_pid": self._jvm_pid()}
        return {
            "task_id": self.idx, "task_type": self.task, "task_number": self.world.codes[self.task],
            "variation": self.variation, "task_description": self.description,
            "score": self._score100, "steps": self._steps,
            "moves": self._moves, "done": self._done, "completed": self._completed,
            "jvm_pid": self._jvm_pid(),
        }

    def _jvm_pid(self) -> int | None:
        return None if self._sw is None else self._sw._gateway.java_process.pid

    # ---- expert: the package's gold path ----
    def expert_action(self) -> str | None:
        """The next gold action while the agent follows the gold path; None once done or off the
        path."""
        self._require_task()
        if self._done:
            return None
        if self._gold is None:
            self._require_jvm()
            self._game(self._load_gold)
        position = 0
        for action, took_time in self._history:
            if position < len(self._gold) and same_action(action, self._gold[position]):
                position += 1
            elif took_time:
                return None  # left the gold path: it may no longer lead anywhere
        return self._gold[position] if position < len(self._gold) else None

    def _load_gold(self) -> None:
        """Reload the game with its gold path and replay the episode so far (see the module
        docstring)."""
        sw = self._sw
        sw.load(self.task, self.variation, "", generateGoldPath=True)
        self._gold = list(sw.get_gold_action_sequence())
        sw.server.step(LOOK_AROUND)
        for action, _ in self._history:
            sw.server.step(action)
        self._score100 = round(100 * sw.server.getScore())
        self._moves = sw.server.getNumMoves()

    def close(self) -> None:
        self._stop_jvm(closing=True)

    def abandon(self) -> None:
        # A hung JVM would hang a polite shutdown too (py4j has no read timeout): kill it first. The
        # stuck call then fails on its closed socket and its thread ends.
        sw = self._sw
        if sw is not None:
            sw._gateway.java_process.kill()
        self._stop_jvm(closing=True)


def write_splits() -> None:
    """Write SPLITS_PATH from the installed package (one JVM): each kept task type's variations by
    split."""
    from scienceworld import ScienceWorldEnv, __version__

    sw = ScienceWorldEnv()
    try:
        types = []
        # the package's task order, which is upstream's game order
        for code, name in sw.tasks.items():
            if code in EXCLUDED_TYPES:
                continue
            sw.load(name, 0, "")
            types.append({"code": code, "name": name, "train": sw.get_variations_train(),
                          "dev": sw.get_variations_dev(), "test": sw.get_variations_test()})
    finally:
        sw.close()
    table = {"source": f"scienceworld {__version__}, task types but {', '.join(EXCLUDED_TYPES)} "
                       "(as AgentGym's agentenv-sciworld); variations by the package's own splits",
             "task_types": types}
    SPLITS_PATH.write_text(json.dumps(table) + "\n")


def main() -> None:
    """`python -m env_server.sciworld [--write-splits]` prints (or rewrites) the game list."""
    parser = argparse.ArgumentParser(description="SciWorld game list tools")
    parser.add_argument("--write-splits", action="store_true",
                        help=f"regenerate {SPLITS_PATH} from the installed scienceworld package "
                             "(starts a JVM)")
    args = parser.parse_args()
    if args.write_splits:
        write_splits()
    world = SciWorldEnv.load_world()
    sizes = {k: len(v) for k, v in world.splits.items()}
    print(f"{len(world.games)} games of {len(world.codes)} task types; splits {sizes}")


if __name__ == "__main__":
    main()
