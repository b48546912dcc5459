"""The real model's speed on this machine: generation by the HF engine against transformers'
`model.generate` on the same prompts, at several batch sizes, and training tokens/s of the update's
forward and backward.

    python bench/real_model.py                          # SmolLM2-135M-Instruct, batches 8 32 64
    python bench/real_model.py --batches 8 --new 32 --model PATH --threads 2

Prompts are the opening prompts of TextCraft test tasks (the chat template's ids, ~300-400 tokens,
left-padded). Both sides sample at temperature 1 with no top-k/top-p and never stop early, so they do
the same work: tokens/s = batch x new tokens / seconds. Each figure is the best of --repeats runs, the
two sides interleaved. Targets (exit status 1 when one is missed): the engine at least as fast as
`model.generate` at every batch size (it must not cost the rollout its speed), and training at least
--train-target tokens/s.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models  # noqa: E402
import policy  # noqa: E402
from agents import opening_messages  # noqa: E402
from engines import HFEngine  # noqa: E402
from env_server import get_env_class  # noqa: E402
from rollout import ChatFormat  # noqa: E402


def prompts_of(fmt: ChatFormat, n: int) -> list[list[int]]:
    cls = get_env_class("textcraft")
    world = cls.load_world(None)
    env = cls(world)
    test = cls.splits(world)["test"]
    return [fmt.prompt_ids(opening_messages("textcraft", env.reset(test[i % len(test)]))) for i in range(n)]


def engine_speed(model, pad: int, prompts, new: int) -> float:
    engine = HFEngine(model, pad)
    t = time.perf_counter()
    out = engine.generate(prompts, new, [], 1.0, 1.0, torch.Generator().manual_seed(0))
    assert all(len(s.ids) == new for s in out)
    return len(prompts) * new / (time.perf_counter() - t)


def generate_speed(model, pad: int, prompts, new: int) -> float:
    L = max(map(len, prompts))
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
    assert out.shape[1] == L + new
    return len(prompts) * new / (time.perf_counter() - t)


def train_speed(model, rows: int, length: int) -> float:
    """Forward and backward of the update's loss path (policy.token_logprobs with a loss mask on the
    second half of each row, as replies are): trained tokens per second."""
    ids = torch.randint(100, 40000, (rows, length))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length).repeat(rows, 1)}
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 2:] = 1
    model.train()
    t = time.perf_counter()
    lp, ent = policy.token_logprobs(model, mb, 1.0, with_entropy=True, mask=mask)
    (-(lp * mask).sum() / mask.sum() - 0.001 * ent.sum()).backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return rows * length / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a built-in name or an HF folder")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--new", type=int, default=64, help="new tokens per row")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--train-rows", type=int, default=4)
    p.add_argument("--train-length", type=int, default=512)
    p.add_argument("--train-target", type=float, default=100.0, help="training tokens/s the machine must reach")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))
    a = p.parse_args()
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    path = models.resolve(a.model, "textcraft", a.cache_dir)
    tok = policy.load_tokenizer(path)
    model = policy.load_model(path).eval()
    fmt, pad = ChatFormat(tok), policy.pad_id(tok)
    print(f"{path}: {sum(x.numel() for x in model.parameters()) / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads, {a.new} new tokens per row")
    met = True
    for b in a.batches:
        prompts = prompts_of(fmt, b)
        best = {"engine": 0.0, "generate": 0.0}
        for _ in range(a.repeats):  # interleaved: the machine's noise hits both sides alike
            best["engine"] = max(best["engine"], engine_speed(model, pad, prompts, a.new))
            best["generate"] = max(best["generate"], generate_speed(model, pad, prompts, a.new))
        ratio = best["engine"] / best["generate"]
        met &= ratio >= 1.0
        print(f"  batch {b:3d} (prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens): HFEngine "
              f"{best['engine']:6.1f} tokens/s, model.generate {best['generate']:6.1f} tokens/s, ratio {ratio:.2f} "
              f"({'met' if ratio >= 1.0 else 'NOT met'}: >= 1.00)")
    speed = max(train_speed(model, a.train_rows, a.train_length) for _ in range(a.repeats))
    met &= speed >= a.train_target
    print(f"  training (forward + backward, {a.train_rows} x {a.train_length} tokens): {speed:6.1f} tokens/s "
          f"({'met' if speed >= a.train_target else 'NOT met'}: >= {a.train_target:g})")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
