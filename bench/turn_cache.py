r"""Two engine options, each off and on, side by side on the same episodes.

    python bench/turn_cache.py --env textcraft --tasks 52 --turns 30 --model PATH
    python bench/turn_cache.py --compare compaction --temperature 1 --max-new-tokens 128 \
        --model PATH

`--compare cache` (default): the KV cache kept across turns. Plays `--tasks` held-out tasks twice
with hf_engine.py's HFEngine, once encoding every prompt in full and once reusing the
previous turn's keys and values (rollout()'s default). `--compare compaction`: decoding only the
rows still generating once half of a batch has stopped (HFEngine's default) against decoding
every row until the last one stops. Prints both wall times, their ratio, the prompt tokens encoded
and the rows computed by decoding, and whether the two played the same episodes. Greedy decoding
(the default) or one seed for both makes the episodes comparable: compaction keeps each row's
sampling stream, so the two differ only where float rounding flips a near tie.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models.builtin as models  # noqa: E402
from trainer.cli import cpu_threads  # noqa: E402
from env_client import EnvPool  # noqa: E402
from tasks import spread  # noqa: E402
from env_server import get_env_class  # noqa: E402
from env_server.process import ServerProcess  # noqa: E402
from hf_engine import HFEngine  # noqa: E402
from models.policy import load_model, load_tokenizer, pad_id, resolve_dtype  # noqa: E402
from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="textcraft")
    p.add_argument("--tasks", type=int, default=52,
                   help="held-out tasks, spread over the test split")
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--model", default=None,
                   help="HF model folder (default: the env's warm-started tiny model)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compare", choices=["cache", "compaction"], default="cache")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; else sampled, the same seed for both")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--cache-dir",
                   default=os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))
    a = p.parse_args()
    torch.set_num_threads(cpu_threads(a.threads))
    path = a.model or models.default_model_path(a.env, a.cache_dir)
    tok, model = load_tokenizer(path), load_model(path)
    model = model.to(resolve_dtype(a.dtype, torch.device("cpu"), model))
    fmt = ChatFormat(tok)
    cls = get_env_class(a.env)
    items = spread(cls.splits(cls.load_world(None))["test"], a.tasks)
    rcfg = RolloutConfig(max_turns=a.turns, max_new_tokens=a.max_new_tokens,
                         temperature=a.temperature)
    settings = {"cache": (("full prompt every turn", {"reuse_ok": False}),
                          ("cache kept across turns", {})),
                "compaction": (("every row to the end", {"compact": False}),
                               ("rows still going", {}))}[a.compare]
    runs = {}
    with ServerProcess(a.env) as server:
        for name, attrs in settings:
            engine = HFEngine(model, pad_id(tok))
            for k, v in attrs.items():
                setattr(engine, k, v)
            gen = torch.Generator().manual_seed(0)
            with EnvPool(server.url, len(items)) as pool:
                t0 = time.perf_counter()
                trajs = rollout(EnginePolicy(engine, fmt, rcfg, gen), pool, a.env, items,
                                list(range(len(items))), rcfg, fmt=fmt)
                runs[name] = (time.perf_counter() - t0, engine, trajs)
    how = "greedy" if a.temperature <= 0 else f"temperature {a.temperature:g}, seed 0"
    print(f"{a.env}: {len(items)} tasks x up to {a.turns} turns, {how}, {a.max_new_tokens} new "
          f"tokens, {next(model.parameters()).dtype}, {path}")
    for name, (wall, engine, trajs) in runs.items():
        turns = sum(t.turns for t in trajs)
        print(f"  {name:24s} {wall:7.1f} s  prompt tokens encoded {engine.encoded_tokens:>9,}  "
              f"reused {engine.reused_tokens:>9,}  decoded rows {engine.decoded_rows:>9,}  "
              f"turns {turns}")
    (w0, _, t0s), (w1, _, t1s) = runs.values()
    same = [a_.token_ids == b_.token_ids for a_, b_ in zip(t0s, t1s)]
    print(f"  speed-up {w0 / w1:.2f}x; identical episodes {sum(same)}/{len(same)} "
          f"(a difference is a float-rounding tie flipped, not an error)")


if __name__ == "__main__":
    main()
