"""Env server throughput: steps/s and latency through single-step and batch calls, next to the
game's in-process step rate, so the HTTP overhead is visible.

    python bench/env_throughput.py --env textcraft --sizes 32,64 --seconds 5

The server runs in its own process (as train.py runs it); the client steps all instances in
lock-step rounds, as the rollout does: one round = one action for every instance. Targets on a
2-core machine (TextCraft): single-step with keep-alive >= 2,000 steps/s at 32 instances; batch >=
15,000 steps/s at 64. Since every call into a game runs on a worker thread under a deadline
(env_server.instances.Runner), the single-step path misses its target: about 1,500 steps/s against
2,100 before (docs/results.md).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from env_client import EnvError, EnvPool  # noqa: E402
from env_server import get_env_class  # noqa: E402
from env_server.process import ServerProcess  # noqa: E402

# Actions that keep an episode going (a finished episode is reset and not counted as a step).
BENCH_ACTIONS = {
    "textcraft": ["inventory", "get 1 oak log", "craft 1 stick using 2 oak planks"],
    "babyai": ["turn left", "turn right", "move forward"],
}


def in_process_rate(env_name: str, seconds: float) -> float:
    env_cls = get_env_class(env_name)
    env = env_cls(env_cls.load_world(None))
    env.reset(0)
    actions, n, t0 = BENCH_ACTIONS[env_name], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for a in actions:
            if env.step(a).done:
                env.reset(0)
            n += 1
    return n / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def run(url: str, env_name: str, size: int, batch: bool, seconds: float) -> dict:
    pool = EnvPool(url, size, use_batch=batch, workers=size)
    actions = BENCH_ACTIONS[env_name]
    ids = [i % 50 for i in range(size)]
    pool.reset(ids)
    lat: list[float] = []  # per request (single) or per round (batch)
    steps = errors = rnd = 0

    def timed_step(i, action):
        t = time.perf_counter()
        try:
            return pool.clients[i].step(action)
        except EnvError as e:
            return e
        finally:
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        action = actions[rnd % len(actions)]
        rnd += 1
        if batch:
            t = time.perf_counter()
            res = pool.step([action] * size)
            lat.append(time.perf_counter() - t)
        else:
            res = list(pool.executor.map(lambda i: timed_step(i, action), range(size)))
        steps += sum(not isinstance(r, EnvError) for r in res)
        errors += sum(isinstance(r, EnvError) for r in res)
        finished = [ids[i] if (not isinstance(r, EnvError) and r.done) else None
                    for i, r in enumerate(res)]
        if any(x is not None for x in finished):
            pool.reset(finished)
    dt = time.perf_counter() - t0
    pool.close()
    return {"mode": "batch" if batch else "single", "instances": size, "steps_per_s": steps / dt,
            "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "errors": errors, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="textcraft", choices=sorted(BENCH_ACTIONS))
    p.add_argument("--sizes", default="32,64", help="comma-separated numbers of parallel instances")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per configuration")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    rate = in_process_rate(args.env, min(args.seconds, 3.0))
    print(f"{args.env}: in-process step rate {rate:,.0f} steps/s (one thread, no HTTP)")
    print(f"{'mode':7s} {'instances':>9s} {'steps/s':>10s} {'p50 ms':>8s} {'p99 ms':>8s}"
          f" {'errors':>7s} {'vs in-process':>14s}   (latency: per request for single, per round "
          f"for batch)")
    with ServerProcess(args.env) as server:
        for batch in (False, True):
            for size in sizes:
                r = run(server.url, args.env, size, batch, args.seconds)
                print(f"{r['mode']:7s} {size:9d} {r['steps_per_s']:10,.0f} {r['p50_ms']:8.2f}"
                      f" {r['p99_ms']:8.2f} {r['errors']:7d} {rate / r['steps_per_s']:13.1f}x")


if __name__ == "__main__":
    main()
