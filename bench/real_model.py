"""The real model's speed on this machine, fp32 and bf16 side by side, against the machine's own
limit.

    python bench/real_model.py                          # SmolLM2-135M-Instruct, batches 8 32 64
    python bench/real_model.py --batches 32 --new 32 --threads 2 --against-generate

It measures, in one run and interleaved (the machine's noise hits both dtypes alike; each figure is
the best of --repeats):
- the machine: matrix-product GFLOP/s in fp32 and bf16 (a 2048 x 576 by 576 x 1536 product, the
  shape of a prefill's MLP), the ceiling that every figure below is compared with;
- prefill: one forward over a batch of TextCraft opening prompts (~300-400 tokens), tokens/s;
- generation: the HF engine sampling --new tokens per row at each batch size (temperature 1, never
  stopping early), new tokens/s; with --against-generate also transformers' `model.generate`;
- training: forward and backward of the update's loss path (policy.token_logprobs on a bf16 copy
  with fp32 master weights, as train.py runs it), trained tokens/s.

Each figure is also printed as a share of the limit: tokens/s x FLOPs per token / matrix GFLOP/s,
with 2 x (parameters) FLOPs per token forward (the LM head once per sampled token; attention left
out) and 3 x that for forward + backward. Decoding is far below the limit on a CPU: one row's token
reads every weight, so it is bound by memory and per-call overhead, not arithmetic.

Targets (exit status 1 when one is missed): bf16 generation at least 2x fp32 at batch 32 and 64, and
bf16 training at least 2.5x fp32.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models.builtin as models  # noqa: E402
from models import policy  # noqa: E402
from hf_engine import HFEngine  # noqa: E402
from distributed import Precision  # noqa: E402
from env_server.agents import opening_messages  # noqa: E402
from env_server import get_env_class  # noqa: E402
from rollout import ChatFormat  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts_of(fmt: ChatFormat, n: int) -> list[list[int]]:
    cls = get_env_class("textcraft")
    world = cls.load_world(None)
    env = cls(world)
    test = cls.splits(world)["test"]
    return [fmt.prompt_ids(opening_messages("textcraft", env.reset(test[i % len(test)])))
            for i in range(n)]


def matmul_gflops(dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 1536,
                  reps: int = 20) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e9


def padded(prompts, pad: int):
    L = max(map(len, prompts))
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    return ids, attn


def prefill_speed(model, pad: int, prompts) -> float:
    ids, attn = padded(prompts, pad)
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attn, logits_to_keep=1)
    return int(attn.sum()) / (time.perf_counter() - t)


def engine_speed(model, pad: int, prompts, new: int) -> float:
    engine = HFEngine(model, pad)
    t = time.perf_counter()
    out = engine.generate(prompts, new, [], 1.0, 1.0, torch.Generator().manual_seed(0))
    assert all(len(s.ids) == new for s in out)
    return len(prompts) * new / (time.perf_counter() - t)


def generate_speed(model, pad: int, prompts, new: int) -> float:
    ids, attn = padded(prompts, pad)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=pad)
    assert out.shape[1] == ids.shape[1] + new
    return len(prompts) * new / (time.perf_counter() - t)


def train_speed(prec: Precision, rows: int, length: int) -> float:
    """Forward and backward of the update's loss path (policy.token_logprobs with a loss mask on the
    second half of each row, as replies are; gradients into the fp32 master): trained tokens per
    second."""
    ids = torch.randint(100, 40000, (rows, length))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
          "position_ids": torch.arange(length).repeat(rows, 1)}
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 2:] = 1
    prec.model.train()
    t = time.perf_counter()
    lp, ent = policy.token_logprobs(prec.model, mb, 1.0, with_entropy=True, mask=mask)
    (-(lp * mask).sum() / mask.sum() - 0.001 * ent.sum()).backward()
    prec.collect_grads()
    speed = rows * length / (time.perf_counter() - t)
    prec.master.zero_grad(set_to_none=True)
    prec.model.eval()
    return speed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a built-in name or an HF folder")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--new", type=int, default=64, help="new tokens per row")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--prefill-batch", type=int, default=32)
    p.add_argument("--train-rows", type=int, default=4)
    p.add_argument("--train-length", type=int, default=512)
    p.add_argument("--against-generate", action="store_true",
                   help="also time transformers' model.generate (fp32)")
    p.add_argument("--cache-dir",
                   default=os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))
    a = p.parse_args()
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    path = models.resolve(a.model, "textcraft", a.cache_dir)
    tok = policy.load_tokenizer(path)
    master = policy.load_model(path).eval()
    precs = {name: Precision(master, dt) for name, dt in DTYPES.items()}
    fmt, pad = ChatFormat(tok), policy.pad_id(tok)
    n_params = sum(x.numel() for x in master.parameters())
    flops = 2 * n_params  # forward FLOPs per token (the tied LM head counted once)
    limit = {name: max(matmul_gflops(dt) for _ in range(max(3, a.repeats)))
             for name, dt in DTYPES.items()}
    print(f"{path}: {n_params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
          f"bf16 native on this CPU: {policy.cpu_has_bf16()}; forward {flops / 1e6:.0f} MFLOP "
          f"per token")
    print(f"matrix product (2048x576 by 576x1536): fp32 {limit['fp32']:.0f} GFLOP/s, "
          f"bf16 {limit['bf16']:.0f} GFLOP/s ({limit['bf16'] / limit['fp32']:.2f}x)")

    def share(tokens_per_s: float, name: str, mult: float = 1.0) -> str:
        return f"{100 * tokens_per_s * mult * flops / 1e9 / limit[name]:5.1f}% of the limit"

    def line(what: str, best: dict, mult: float = 1.0) -> float:
        ratio = best["bf16"] / best["fp32"]
        print(f"  {what:34s} fp32 {best['fp32']:8.1f} ({share(best['fp32'], 'fp32', mult)})   "
              f"bf16 {best['bf16']:8.1f} ({share(best['bf16'], 'bf16', mult)})   {ratio:.2f}x")
        return ratio

    prompts = prompts_of(fmt, a.prefill_batch)
    best = dict.fromkeys(DTYPES, 0.0)
    for _ in range(a.repeats):  # interleaved
        for n in DTYPES:
            best[n] = max(best[n], prefill_speed(precs[n].model, pad, prompts))
    line(f"prefill, batch {a.prefill_batch}, tokens/s", best)
    met, results = True, {}
    for b in a.batches:
        prompts = prompts_of(fmt, b)
        best = dict.fromkeys(DTYPES, 0.0)
        for _ in range(a.repeats):  # interleaved
            for n in DTYPES:
                best[n] = max(best[n], engine_speed(precs[n].model, pad, prompts, a.new))
        results[b] = line(f"generation, batch {b:2d}, new tokens/s", best)
        if b in (32, 64):
            met &= results[b] >= 2.0
        if a.against_generate:
            g = max(generate_speed(master, pad, prompts, a.new) for _ in range(a.repeats))
            print(f"  {'':34s} model.generate fp32 {g:8.1f} new tokens/s "
                  f"(the engine: {best['fp32'] / g:.2f}x)")
    best = dict.fromkeys(DTYPES, 0.0)
    for _ in range(a.repeats):
        for n in DTYPES:
            best[n] = max(best[n], train_speed(precs[n], a.train_rows, a.train_length))
    train_ratio = line(f"training {a.train_rows}x{a.train_length}, tokens/s", best, mult=3.0)
    met &= train_ratio >= 2.5
    print("targets: bf16 generation >= 2x fp32 at batch 32 and 64: " +
          ", ".join(f"batch {b} {r:.2f}x" for b, r in results.items() if b in (32, 64)) +
          f"; bf16 training >= 2.5x fp32: {train_ratio:.2f}x -> {'met' if met else 'NOT met'}")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
