"""Soak: an env server under a steady churn of instances for minutes, to show that its memory stays
flat and that instances abandoned without /close are reaped.

    python bench/soak.py --env textcraft babyai --minutes 10

Per env, a server process runs with a short --idle-timeout and the client plays rounds: create a
pool of --instances, reset them to train tasks, play --steps steps (the expert's action for
--expert-share of the instances, else a random valid, failing or junk action; finished episodes
restart on another task), then abandon --abandon-share of the instances (no /close: the server's
reaper must close them) and close the rest. Every --sample-s seconds a row shows the elapsed time,
live instances, instances abandoned and reaped so far, the server's RSS (VmRSS of its process, read
from /proc; SciWorld's JVMs are separate processes and not counted), steps/s since the last row, and
errors.

RSS is compared as the peak over a window, since a sample lands anywhere in a round (a full pool or
an empty one): the peak over the first window after warm-up (the first fifth of the run) against the
peak over the last window of the same length. At the end the soak waits for the reaper to close the
last abandoned instances. Exit status 1 when RSS grew by more than --max-rss-growth percent, on any
error (refused or malformed answer), or when an abandoned instance was not reaped.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from env_client import EnvError, EnvPool, Step, Transport  # noqa: E402
from tasks import task_splits  # noqa: E402
from env_server.process import ServerProcess  # noqa: E402

# Besides the expert's moves: random actions that succeed, fail inside the game, or are junk the
# game must survive (empty, unknown, absurd numbers). None of them may ever be an error of the
# server. SciWorld: "focus on door" is ambiguous and asks for a number ("0"), "focus on air" fails
# the task.
OTHER_ACTIONS = {
    "textcraft": ["inventory", "get 1 oak log", "get 4 oak planks",
                  "craft 4 oak planks using 1 oak log", "craft 1 stick using 2 oak planks",
                  "craft 1 diamond using 1 dirt", "get 99999999999 dirt", "get -1 stick",
                  "jump", ""],
    "babyai": ["turn left", "turn right", "move forward", "pickup", "toggle", "drop",
               "check available actions", "go to red ball 1", "pickup grey key 1",
               "toggle and go through blue door 1", "fly", ""],
    "corridor": ["left", "right", "wait", "left, no, right", "RIGHT.", ""],
    "searchqa": ["<search>who founded the company</search>", "<search>inventor</search>",
                 "<search></search>", "<answer>Paris</answer>", "<answer></answer>",
                 "no tags at all", "<search>unclosed", ""],
    "sciworld": ["look around", "inventory", "task", "open door to kitchen", "go to hallway",
                 "go to kitchen", "pick up thermometer", "focus on door", "0", "focus on air",
                 "wait1", "dance"],
}
WARMUP_SHARE = 0.2  # RSS is compared from the end of this share of the run on


@dataclass
class Tally:
    """What a load run did; updated as it goes, so that another thread can print it."""
    steps: int = 0
    episodes: int = 0  # episodes that ended and were restarted
    expert_actions: int = 0
    n_errors: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, one line each

    def error(self, what: str) -> None:
        self.n_errors += 1
        if len(self.errors) < 20:
            self.errors.append(what)


def malformed(step: Step) -> str | None:
    """Why a step answer breaks the protocol of app.py, or None when it is well formed."""
    raw = step.raw
    types = {"observation": str, "reward": (int, float), "score": (int, float), "done": bool,
             "info": dict}
    for key, want in types.items():
        if key not in raw:
            return f"step answer without {key!r}: {str(raw)[:200]}"
        if not isinstance(raw[key], want) or (want != bool and isinstance(raw[key], bool)):
            return f"step answer with {key}={raw[key]!r}"
    return None


def spread(ids: list[int], n: int) -> list[int]:
    """n task ids spread evenly over `ids` (repeating when n > len(ids))."""
    return [ids[i * len(ids) // n] for i in range(n)]


def pick_actions(pool: EnvPool, env: str, rng: random.Random, expert_share: float,
                 tally: Tally) -> list[str]:
    """One action per instance: the expert's (GET /expert_action, in parallel) for a random share of
    the instances, a random one from OTHER_ACTIONS for the rest and where the expert has no move."""
    actions = [rng.choice(OTHER_ACTIONS[env]) for _ in range(pool.size)]
    ask = [i for i in range(pool.size) if rng.random() < expert_share]

    def expert(i):
        try:
            return pool.clients[i].expert_action()
        except EnvError as e:
            return e

    for i, a in zip(ask, pool.executor.map(expert, ask)):
        if isinstance(a, EnvError):
            tally.error(f"expert_action of instance {pool.clients[i].id}: {a}")
        elif a is not None and not isinstance(a, str):
            tally.error(f"expert_action of instance {pool.clients[i].id} is not a string: {a!r}")
        elif a is not None:
            actions[i] = a
            tally.expert_actions += 1
    return actions


def play(pool: EnvPool, env: str, train: list[int], steps: int, rng: random.Random,
         expert_share: float, tally: Tally) -> None:
    """Reset the instances of `pool` to train tasks spread over the split (from a random start),
    then step all of them `steps` times; an instance whose episode ended is reset to a random train
    task before the next step. Failures go to `tally`."""

    def check_resets(obs: list, ids: list) -> None:
        for iid, o in zip(ids, obs):
            if isinstance(o, EnvError):
                tally.error(f"reset of instance {iid}: {o}")
            elif not isinstance(o, str) or not o:
                tally.error(f"reset of instance {iid} answered {o!r}")

    k = rng.randrange(len(train))
    check_resets(pool.reset(spread(train[k:] + train[:k], pool.size)), [c.id for c in pool.clients])
    for _ in range(steps):
        results = pool.step(pick_actions(pool, env, rng, expert_share, tally))
        restart: list[int | None] = [None] * pool.size
        for i, r in enumerate(results):
            problem = str(r) if isinstance(r, EnvError) else malformed(r)
            if problem:
                tally.error(f"step of instance {pool.clients[i].id}: {problem}")
                continue
            tally.steps += 1
            if r.done:
                restart[i] = rng.choice(train)
                tally.episodes += 1
        done = [i for i, t in enumerate(restart) if t is not None]
        if done:
            obs = pool.reset(restart)
            check_resets([obs[i] for i in done], [pool.clients[i].id for i in done])


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` (VmRSS from /proc/PID/status), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def peak(samples: list[dict], t0: float, t1: float) -> float:
    """The highest RSS of the samples taken in [t0, t1] (the nearest sample when none was)."""
    inside = [s["rss_mb"] for s in samples if t0 <= s["t"] <= t1]
    return max(inside) if inside else min(samples, key=lambda s: abs(s["t"] - t0))["rss_mb"]


def soak(env: str, args) -> bool:
    """Soak one env; print the table and the verdict; return whether it passed."""
    print(f"== {env}: {args.minutes:g} min, {args.instances} instances x {args.steps} steps "
          f"per round, abandon {args.abandon_share:.0%}, idle timeout {args.idle_timeout:g} s",
          flush=True)
    rng = random.Random(args.seed)
    tally, abandoned, rounds = Tally(), 0, 0
    samples: list[dict] = []
    with ServerProcess(env, "--idle-timeout", str(args.idle_timeout),
                       *shlex.split(args.server_args)) as server:
        health = Transport(server.url)
        train = task_splits(server.url, env)["splits"]["train"]
        start = time.monotonic()
        stop = threading.Event()

        def sample() -> dict:
            """One row of the table, printed and kept."""
            t = time.monotonic() - start
            try:
                h = health.request("GET", "/", retry=True)
            except EnvError as e:
                tally.error(f"health: {e}")
                h = {"instances": -1, "reaped": -1}
            last = samples[-1] if samples else {"t": 0.0, "steps": 0}
            row = {"t": t, "live": h["instances"], "abandoned": abandoned, "reaped": h["reaped"],
                   "rss_mb": rss_mb(server.proc.pid), "steps": tally.steps,
                   "errors": tally.n_errors}
            row["steps_per_s"] = (row["steps"] - last["steps"]) / max(t - last["t"], 1e-9)
            samples.append(row)
            print(f"{t:9.0f} {row['live']:6d} {abandoned:10d} {row['reaped']:8d}"
                  f" {row['rss_mb']:8.1f} {row['steps_per_s']:9,.0f} {row['errors']:7d}",
                  flush=True)
            return row

        def sampler():
            while not stop.wait(args.sample_s):
                sample()

        print(f"{'elapsed_s':>9s} {'live':>6s} {'abandoned':>10s} {'reaped':>8s} {'rss_mb':>8s}"
              f" {'steps/s':>9s} {'errors':>7s}", flush=True)
        sample()
        sampler_thread = threading.Thread(target=sampler, daemon=True)
        sampler_thread.start()
        while time.monotonic() - start < args.minutes * 60:
            try:
                pool = EnvPool(server.url, args.instances)
            except EnvError as e:
                tally.error(f"pool of {args.instances}: {e}")
                time.sleep(1)
                continue
            play(pool, env, train, args.steps, rng, args.expert_share, tally)
            drop = rng.sample(range(args.instances), round(args.abandon_share * args.instances))
            for i in drop:
                # abandoned: EnvPool.close skips it, so no /close is ever sent
                pool.clients[i] = None
            abandoned += len(drop)
            pool.close()
            rounds += 1
        end = time.monotonic() - start
        stop.set()
        sampler_thread.join()

        # Drain: every abandoned instance must be gone within about one idle timeout (plus reaper
        # period).
        deadline = time.monotonic() + 2 * args.idle_timeout + 10
        while time.monotonic() < deadline:
            last = sample()
            if last["live"] == 0:
                break
            time.sleep(max(0.5, args.idle_timeout / 4))

    warm = WARMUP_SHARE * end
    window = max(warm, 2 * args.sample_s)
    rss_warm, rss_end = peak(samples, warm, warm + window), peak(samples, end - window, end)
    growth = 100 * (rss_end / rss_warm - 1)
    print(f"{env}: {rounds} rounds, {tally.steps:,} steps ({tally.steps / end:,.0f} steps/s), "
          f"{tally.episodes:,} episodes, {tally.expert_actions:,} expert actions, "
          f"{tally.n_errors} errors; abandoned {abandoned}, reaped {last['reaped']}, "
          f"live at the end {last['live']}")
    print(f"{env}: RSS peak after warm-up ({warm:.0f}-{warm + window:.0f} s) {rss_warm:.1f} MB, "
          f"at the end ({end - window:.0f}-{end:.0f} s) {rss_end:.1f} MB: {growth:+.1f}% "
          f"(limit {args.max_rss_growth:g}%); after draining {last['rss_mb']:.1f} MB", flush=True)
    failures = []
    if growth > args.max_rss_growth:
        failures.append(f"RSS grew by {growth:.1f}% > {args.max_rss_growth:g}%")
    if tally.n_errors:
        failures.append(f"{tally.n_errors} errors, first: " + "; ".join(tally.errors[:3]))
    if last["live"] != 0 or last["reaped"] != abandoned:
        failures.append(f"{abandoned} instances abandoned, {last['reaped']} reaped, "
                        f"{last['live']} still live")
    for f in failures:
        print(f"{env}: FAIL: {f}", flush=True)
    return not failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", nargs="+", default=["textcraft"], choices=sorted(OTHER_ACTIONS),
                   help="environments to soak, one after the other")
    p.add_argument("--minutes", type=float, default=3.0, help="how long to soak each env")
    p.add_argument("--instances", type=int, default=64, help="instances per round")
    p.add_argument("--steps", type=int, default=20, help="steps per instance per round")
    p.add_argument("--expert-share", type=float, default=0.2,
                   help="share of actions asked from the env's expert "
                        "(one GET each; BabyAI's takes ~10 ms)")
    p.add_argument("--abandon-share", type=float, default=0.25,
                   help="share of each round's instances left without /close, for the reaper")
    p.add_argument("--idle-timeout", type=float, default=5.0,
                   help="the server's --idle-timeout in seconds; must exceed the longest gap "
                        "between two requests to a live instance (one step of the whole pool), "
                        "or live ones get reaped")
    p.add_argument("--max-rss-growth", type=float, default=10.0,
                   help="fail when the server's RSS grows by more than this many percent "
                        "after warm-up")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between rows of the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="more flags for `python -m env_server ENV`, "
                        "e.g. --server-args='--max-jvms 8'")
    args = p.parse_args()
    if not 0 <= args.abandon_share <= 1 or not 0 <= args.expert_share <= 1:
        p.error("--abandon-share and --expert-share are shares: between 0 and 1")
    if args.instances < 1 or args.steps < 1 or args.idle_timeout <= 0 or args.sample_s <= 0:
        p.error("--instances and --steps must be at least 1, --idle-timeout and --sample-s above 0")

    passed = [soak(env, args) for env in args.env]
    sys.exit(0 if all(passed) else 1)


if __name__ == "__main__":
    main()
