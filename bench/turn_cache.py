"""The KV cache kept across turns: the same episodes played with and without it, side by side.

    python bench/turn_cache.py --env textcraft --tasks 52 --turns 30 --model PATH

Plays `--tasks` held-out tasks greedily twice with HFEngine, once encoding every prompt in full and
once reusing the previous turn's keys and values (rollout()'s default), and prints both wall times,
their ratio, the prompt tokens each run encoded, and whether the two played the same episodes. Greedy
decoding makes the episodes comparable; the log-probs of the two differ only by float rounding.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models  # noqa: E402
from cli import cpu_threads  # noqa: E402
from engines import HFEngine  # noqa: E402
from env_client import EnvPool, spread  # noqa: E402
from env_server import get_env_class  # noqa: E402
from env_server.app import ServerProcess  # noqa: E402
from policy import load_model, load_tokenizer, pad_id  # noqa: E402
from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="textcraft")
    p.add_argument("--tasks", type=int, default=52, help="held-out tasks, spread over the test split")
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--model", default=None, help="HF model folder (default: the env's warm-started tiny model)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))
    a = p.parse_args()
    torch.set_num_threads(cpu_threads(a.threads))
    path = a.model or models.default_model_path(a.env, a.cache_dir)
    tok, model = load_tokenizer(path), load_model(path)
    fmt = ChatFormat(tok)
    cls = get_env_class(a.env)
    items = spread(cls.splits(cls.load_world(None))["test"], a.tasks)
    rcfg = RolloutConfig(max_turns=a.turns, max_new_tokens=a.max_new_tokens, temperature=0.0)
    runs = {}
    with ServerProcess(a.env) as server:
        for name, reuse in (("full prompt every turn", False), ("cache kept across turns", True)):
            engine = HFEngine(model, pad_id(tok))
            engine.reuse_ok = reuse
            with EnvPool(server.url, len(items)) as pool:
                t0 = time.perf_counter()
                trajs = rollout(EnginePolicy(engine, fmt, rcfg), pool, a.env, items, list(range(len(items))), rcfg, fmt=fmt)
                runs[name] = (time.perf_counter() - t0, engine, trajs)
    print(f"{a.env}: {len(items)} tasks x up to {a.turns} turns, greedy, {path}")
    for name, (wall, engine, trajs) in runs.items():
        turns = sum(t.turns for t in trajs)
        print(f"  {name:24s} {wall:7.1f} s  prompt tokens encoded {engine.encoded_tokens:>9,}  "
              f"reused {engine.reused_tokens:>9,}  turns {turns}")
    (w0, _, t0s), (w1, _, t1s) = runs.values()
    same = [a_.token_ids == b_.token_ids for a_, b_ in zip(t0s, t1s)]
    print(f"  speed-up {w0 / w1:.2f}x; identical episodes {sum(same)}/{len(same)} "
          f"(a difference is a float-rounding tie flipped, not an error)")


if __name__ == "__main__":
    main()
