"""Rollout overhead and training throughput on CPU.

    python bench/rollout_overhead.py --env textcraft --trajectories 64 --turns 10

Rollout: wall time of `rollout()` against the time spent inside the engine's `generate` for the same
tokens; the rest is env stepping over HTTP, tokenising observations and the per-turn template check.
Target: rollout / generation <= 1.2 at 64 parallel trajectories on TextCraft.
Training: one GRPO update over the rollout's trajectories: trained tokens/s and the share of padding
in the micro-batches (target < 15%, from length bucketing).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models.builtin as models  # noqa: E402
import train  # noqa: E402
from trainer.cli import cpu_threads  # noqa: E402
from trainer.setup import update_run  # noqa: E402
from env_client import EnvPool  # noqa: E402
from env_server.process import ServerProcess  # noqa: E402
from hf_engine import HFEngine  # noqa: E402
from models.policy import load_model, load_tokenizer, pad_id  # noqa: E402
from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout  # noqa: E402


class TimedEngine(HFEngine):
    """HFEngine (what train.py samples with) that adds up the seconds spent generating."""

    seconds = 0.0

    def generate(self, *a, **kw):
        t = time.perf_counter()
        try:
            return super().generate(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="textcraft")
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--model", default=None,
                   help="HF model folder (default: the built-in tiny model)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    cfg = train.parse_args(["--env", a.env, "--algo", "grpo", "--group-size", "4",
                            "--batch-size", str(max(1, a.trajectories // 4)),
                            "--max-new-tokens", str(a.max_new_tokens),
                            "--micro-batch-tokens", str(a.micro_batch_tokens),
                            "--threads", str(a.threads)]
                           + (["--model", a.model] if a.model else []))
    torch.set_num_threads(cpu_threads(cfg.threads))
    path = (models.resolve(cfg.model, cfg.env, cfg.cache_dir) if cfg.model
            else models.tiny_model_path(cfg.env, cfg.cache_dir))
    tok, model = load_tokenizer(path), load_model(path)
    fmt = ChatFormat(tok)
    engine = TimedEngine(model, pad_id(tok))
    n = a.trajectories
    with ServerProcess(a.env) as server:
        pool = EnvPool(server.url, n)
        rcfg = RolloutConfig(max_turns=a.turns, max_new_tokens=a.max_new_tokens)
        t0 = time.perf_counter()
        policy = EnginePolicy(engine, fmt, rcfg, torch.Generator().manual_seed(0))
        trajs = rollout(policy, pool, a.env, [i // 4 for i in range(n)], [i // 4 for i in range(n)],
                        rcfg, fmt=fmt)
        wall = time.perf_counter() - t0
        pool.close()
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    print(f"rollout: {n} trajectories x up to {a.turns} turns, {gen_tokens} generated tokens")
    print(f"  wall {wall:.2f} s, inside generate {engine.seconds:.2f} s, "
          f"rollout / generation = {wall / engine.seconds:.3f}  (target <= 1.2)")
    optims = {"policy": torch.optim.AdamW(model.parameters(), lr=1e-6)}
    t1 = time.perf_counter()
    run = update_run(cfg, model, optims, pad=pad_id(tok))
    rows = train.Rows(run, trajs)  # what the update reads of a run
    m = train.update(run, rows, *train.advantages(run, rows))
    dt = time.perf_counter() - t1
    if m["padding_share"] is None:  # every advantage 0, no KL or entropy term: none forwarded
        print(f"training: no row forwarded (every row idle), {dt:.2f} s")
        return
    print(f"training: {m['train_tokens']} tokens in {dt:.2f} s = {m['train_tokens'] / dt:,.0f} "
          f"tokens/s, padding share {m['padding_share']:.1%}  (target < 15%)")


if __name__ == "__main__":
    main()
