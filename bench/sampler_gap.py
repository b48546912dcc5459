r"""How far the sampler's log-probs lie from the trainer's on recorded rows: whether the update must
recompute the PPO ratio's old log-probs (train.update recomputes them where the compute dtype is not
fp32, with --tis-cap, or for vLLM with top_p < 1).

    python bench/sampler_gap.py RUN/rollouts/step_000001.jsonl --env textcraft \
        --model smollm2-135m-sft
    python bench/sampler_gap.py eval.json.partial.jsonl --env textcraft --model smollm2-135m-sft \
        --rows 64

The first --rows rows of a trajectory log (a run's step log, an evaluation's rollouts or its partial
file) are scored by the trainer's forward (models.policy.token_logprobs in --dtype, at
--temperature, which must be the rows' own) and compared, token by token over the sampled tokens,
with the log-probs the sampler recorded. It prints the mean and largest |difference|, and the share
of tokens whose ratio exp(trainer - sampler) leaves [1 - clip, 1 + clip]: where taking the sampler's
log-probs as the ratio's denominator would change what the first mini-batch clips.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from algos import INPUTS  # noqa: E402
from models.builtin import resolve  # noqa: E402
from distributed import Precision  # noqa: E402
from models.policy import (load_model, load_tokenizer,  # noqa: E402
                           pad_id, resolve_dtype, token_logprobs)
from recipes.sft import load_log  # noqa: E402
from distributed import build_batch, length_buckets  # noqa: E402
from trainer.cli import cpu_threads  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a JSONL trajectory log")
    p.add_argument("--env", required=True, help="the env the rows were played on")
    p.add_argument("--model", required=True, help="the policy that sampled them")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/agentgym-rl-mini"))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if not os.path.isfile(a.log):
        raise SystemExit(f"sampler_gap.py: no trajectory log {a.log}")
    rows = [t for t in load_log(a.log) if any(t.loss_mask)][:a.rows]
    if not rows:
        raise SystemExit(f"sampler_gap.py: {a.log} holds no row with sampled tokens")
    torch.set_num_threads(cpu_threads(a.threads, leave_one=False))
    path = resolve(a.model, a.env, a.cache_dir)
    master = load_model(path).eval()
    dtype = resolve_dtype(a.dtype, torch.device("cpu"), master)
    model = Precision(master, dtype).model
    batch = build_batch(rows, pad_id(load_tokenizer(path)))
    mask, sampler = batch["loss_mask"][:, 1:], batch["old_logprobs"][:, 1:]
    trainer = torch.zeros_like(sampler)
    lengths = batch["attention_mask"].sum(-1).tolist()
    with torch.no_grad():
        for bucket in length_buckets(lengths, a.micro_batch_tokens):
            mb = {k: batch[k][bucket] for k in INPUTS}
            trainer[bucket] = token_logprobs(model, mb, a.temperature, mask=mask[bucket])[0]
    sel = mask > 0
    diff = (trainer - sampler)[sel].double()
    outside = ((diff.exp() - 1).abs() > a.clip).double().mean()
    print(f"{len(rows)} rows, {int(sel.sum())} sampled tokens, trainer in {str(dtype)[6:]}, "
          f"model {path}")
    print(f"|trainer - sampler| per token: mean {diff.abs().mean():.2e}, "
          f"max {diff.abs().max():.2e}; ratio outside [1 - {a.clip}, 1 + {a.clip}]: "
          f"{100 * outside:.3f}% of tokens")
    print(json.dumps({"rows": len(rows), "tokens": int(sel.sum()), "dtype": str(dtype)[6:],
                      "mean_abs": float(diff.abs().mean()), "max_abs": float(diff.abs().max()),
                      "outside_clip": float(outside)}))


if __name__ == "__main__":
    main()
