"""The seed framework's other training paradigms, on the same token path as the RL rollouts.

    python sft.py --env textcraft --out runs/sft-textcraft --noise 0.2 --epochs 3   # SFT warm start
    python sft.py --env corridor --out runs/evol --mode agentevol --iterations 2    # AgentEvol
    python sft.py --env textcraft --out runs/dpo --mode dpo --from-log runs/x/rollouts  # multi-turn DPO

- SFT (behavioural cloning, AgentGym's "AgentTraj" warm start): cross-entropy on the assistant tokens of
  expert trajectories, token mean over loss_mask = 1, nothing learned from observation tokens.
- AgentEvol (Xi et al. 2024, "AgentGym"): sample on training tasks with the current model, keep the
  successful trajectories, fine-tune on them plus all earlier data, repeat.
- DPO (Rafailov et al. 2023), multi-turn: a trajectory's log-prob is the sum over its assistant tokens;
  pairs are a success against a failure on the same task.

Expert trajectories are built exactly as rollout.rollout() builds a row: prompt ids of the opening
messages, then each reply's ids + the end-of-turn token (loss mask 1), then the observation turn's ids
from ChatFormat.observation_ids (loss mask 0). So a warm-started model is trained on the very token
boundaries it will later sample on.

Departures, and why:
1. AgentEvol fine-tunes the current model each iteration (the paper restarts from the base model on the
   merged data); continuing is cheaper and, on the small data here, reaches the same place.
2. Expert noise (`--noise p`) swaps the expert's action for a plausible wrong one with probability p, so
   the warm start is deliberately imperfect and RL has something left to fix. A guesser (`--guess g`)
   makes the imperfection one RL can find fast: a share g of the data opens with a guess and goes on
   guessing (or, with `--guess-action`, stalls on that one action, as BabyAI's warm start does).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import inspect
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from env_client import parse_action
from agents import GUESS_THOUGHT, STALL_THOUGHT, opening_messages, opens_by_guessing, react_reply
from rollout import ChatFormat, HFEngine, RolloutConfig, Trajectory, build_batch, length_buckets, rollout
from train import arg, check_positive, config_parser, spread, token_logprobs


def is_success(t: Trajectory) -> bool:
    return t.status == "done" and t.reward > 0


# ---------------------------------------------------------------- expert data
def wrong_action(env, first_observation: str, expert: str, rng: random.Random) -> str | None:
    """A plausible but wrong action: another concrete action the env lists, a crafting command from the
    task's own list (TextCraft), or `inventory`. None when there is nothing else to say."""
    listed = [a for a in env.available_actions() if " N " not in f" {a} "]  # drop templates ("get N item")
    crafts = [ln.strip() for ln in first_observation.splitlines() if ln.startswith("craft ")]
    extra = ["inventory"] if getattr(env, "name", "") == "textcraft" else []
    candidates = sorted({a for a in listed + crafts + extra if a != expert})
    return rng.choice(candidates) if candidates else None


def expert_trajectories(env_name: str, item_ids: list[int], fmt: ChatFormat, noise: float = 0.0, seed: int = 0,
                        max_turns: int = 30, variants: int = 1, thoughts: bool = True, guess: float = 0.0,
                        guess_turns: int = 3, guess_action: str | None = None) -> list[Trajectory]:
    """Play each task in-process with the env's expert; one Trajectory per task, built like rollout()'s.

    The reply text is agents.react_reply(action, thought), the thought from the env's `expert_thought`
    where it has one and `thoughts` is on (TextCraft: the listed recipes from the goal down to the
    action's item), else `I will <action>.`; a swapped-in wrong action gets the plain thought. Its ids
    are fmt.reply_ids(reply) (loss mask 1), the observation's are fmt.observation_ids(obs,
    reply_ended=True) (loss mask 0). Status and reward as in rollout(): `done` with the step's reward,
    else `max_turns`; the observation after the last turn goes into the messages but not into the row.
    With `variants` v > 1, envs whose reset takes a `variant` (TextCraft: other distractors, another
    order) play every task in v versions.

    With `guess` g > 0, a second demonstrator joins: a guesser, who plays a share g of all the returned
    trajectories (after the expert's, on the tasks in shuffled turn). Every one of its replies thinks
    GUESS_THOUGHT and takes a plausible wrong action (wrong_action), for `guess_turns` turns; a model
    cloned on the mix starts an episode as the guesser with probability about g, and RL has to find
    out that guessing does not pay. With `guess_action` the guesser stalls instead: every reply
    thinks STALL_THOUGHT and takes that one action (BabyAI: `check available actions`, which changes
    nothing, so each turn looks like the one before and the habit holds to the horizon).
    """
    from env_server import get_env_class

    assert 0.0 <= noise <= 1.0, f"noise is a probability, got {noise}"
    assert 0.0 <= guess < 1.0, f"guess is the guesser's share of the data, in [0, 1), got {guess}"
    env_cls = get_env_class(env_name)
    world = env_cls.load_world(None)
    rng = random.Random(seed)
    has_variants = "variant" in inspect.signature(env_cls.reset).parameters
    if variants > 1 and not has_variants:
        raise ValueError(f"{env_name} has no task variants: use more task ids instead of variants={variants}")
    episodes = [(i, v, False) for v in range(variants) for i in item_ids]
    n_guess = round(len(episodes) * guess / (1.0 - guess))
    order = []  # the guesser's tasks: whole shuffled passes over item_ids, as many as needed
    while len(order) < n_guess:
        order += rng.sample(item_ids, len(item_ids))
    episodes += [(item, 0, True) for item in order[:n_guess]]
    trajs = []
    for group, (item, variant, guesser) in enumerate(episodes):
        env = env_cls(world)
        stalls = guesser and guess_action is not None
        try:
            first = env.reset(item, variant=variant) if has_variants else env.reset(item)
            t = Trajectory(env_name, item, group, opening_messages(env_name, first), [], [], [])
            t.token_ids = fmt.prompt_ids(t.messages)
            t.n_prompt = len(t.token_ids)
            t.loss_mask, t.logprobs = [0] * t.n_prompt, [0.0] * t.n_prompt
            while True:
                action = guess_action if stalls else env.expert_action()
                if action is None:  # the expert has nothing to say: the episode cannot go on
                    t.status = "max_turns"
                    break
                if stalls:
                    thought = STALL_THOUGHT
                elif guesser:
                    action, thought = wrong_action(env, first, action, rng) or action, GUESS_THOUGHT
                else:
                    thought = env.expert_thought(action) if thoughts and hasattr(env, "expert_thought") else None
                    if noise > 0 and rng.random() < noise:
                        if wrong := wrong_action(env, first, action, rng):
                            action, thought = wrong, None
                reply = react_reply(env_name, action, thought)
                reply_ids = fmt.reply_ids(reply)
                t.token_ids += reply_ids
                t.loss_mask += [1] * len(reply_ids)
                t.logprobs += [0.0] * len(reply_ids)  # not sampled: no sampler log-prob
                t.turns += 1
                t.messages.append({"role": "assistant", "content": reply})
                parsed = parse_action(env_name, reply)  # the env sees what the parser makes of the reply
                r = env.step(parsed.action)
                t.messages.append({"role": "user", "content": r.observation})
                t.reward = r.score if r.score is not None else r.reward  # what the HTTP client reports
                if r.done:
                    t.status = "done"
                    break
                if t.turns >= (guess_turns if guesser else max_turns):
                    t.status = "max_turns"
                    break
                obs_ids = fmt.observation_ids(r.observation, reply_ended=True)
                t.token_ids += obs_ids
                t.loss_mask += [0] * len(obs_ids)
                t.logprobs += [0.0] * len(obs_ids)
        finally:
            env.close()
        trajs.append(t)
    return trajs


def load_log(path: str, successful_only: bool = False) -> list[Trajectory]:
    """Trajectories from a trajectory log: one rollouts/step_*.jsonl file, or a folder of them (a run
    folder works too: its rollouts/ is searched). Env errors are dropped (they hold no row)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "step_*.jsonl")) or
                       glob.glob(os.path.join(path, "rollouts", "step_*.jsonl")))
        if not files:
            raise FileNotFoundError(f"no step_*.jsonl trajectory logs in {path} (nor in {path}/rollouts)")
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


# ---------------------------------------------------------------- SFT
def _rows(batch: dict, idx: list[int], device) -> dict:
    T = int(batch["attention_mask"][idx].sum(-1).max())  # cut the micro-batch's padding
    return {k: batch[k][idx, :T].to(device) for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")}


def warmup_cosine(i: int, total: int, warmup: float = 0.05) -> float:
    """Learning-rate factor at optimizer step i of `total`: linear warm-up over the first 5%, then a
    cosine decay to 10% of the peak."""
    w = max(1, int(total * warmup))
    if i < w:
        return (i + 1) / w
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (i - w) / max(1, total - w))))


def sft(model, tokenizer, trajectories: list[Trajectory], epochs: int = 3, lr: float = 1e-4,
        micro_batch_tokens: int = 8192, batch_size: int = 16, max_grad_norm: float = 1.0, weight_decay: float = 0.0,
        seed: int = 0, progress: bool = True) -> list[float]:
    """Supervised fine-tuning: token-mean cross-entropy over the loss_mask = 1 tokens (the replies and
    their end-of-turn tokens), AdamW, `batch_size` trajectories per optimizer step, micro-batched by
    length, with a warm-up + cosine learning-rate schedule. Returns the mean loss of each epoch
    (measured on the fly, before each step's update)."""
    assert trajectories, "sft needs at least one trajectory"
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = build_batch(trajectories, pad_id)
    mask = batch["loss_mask"][:, 1:]  # (B, T-1): token t+1 is predicted from the logits at t
    lengths = batch["attention_mask"].sum(-1).tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rng = random.Random(seed)
    model.train()
    B = len(trajectories)
    total = epochs * -(-B // batch_size)  # optimizer steps in all
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: warmup_cosine(i, total))
    losses = []
    bar = tqdm(range(epochs), desc="sft", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        perm = list(range(B))
        rng.shuffle(perm)
        nll_sum, tok_sum = 0.0, 0.0
        for s in range(0, B, batch_size):
            mini = perm[s:s + batch_size]
            n_tokens = float(mask[mini].sum().clamp(min=1))
            opt.zero_grad(set_to_none=True)
            for idx_local in length_buckets([lengths[i] for i in mini], micro_batch_tokens):
                idx = [mini[i] for i in idx_local]
                mb = _rows(batch, idx, device)
                m = mb["loss_mask"][:, 1:]
                lp, _ = token_logprobs(model, mb, temperature=1.0, mask=m)  # (b, T-1), 0 where m = 0
                nll = -(torch.where(m > 0, lp, 0.0)).sum()
                (nll / n_tokens).backward()  # micro-batches add up to the mini-batch's token mean
                nll_sum, tok_sum = nll_sum + float(nll.detach()), tok_sum + float(m.sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
        losses.append(nll_sum / max(tok_sum, 1.0))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


# ---------------------------------------------------------------- copy pre-training
def copy_batch(rng: random.Random, vocab: list[int], spans: list[list[int]], batch_size: int, max_len: int):
    """`batch_size` sequences shown twice, `seg + seg`, with a loss mask on the second copy only. Even rows
    are random tokens from `vocab`, odd rows spans of `spans` (env text); each segment has 8 to `max_len`
    tokens. Returns lists of (ids, mask)."""
    rows = []
    for b in range(batch_size):
        if b % 2 == 0 or not spans:
            seg = [rng.choice(vocab) for _ in range(rng.randint(8, max_len))]
        else:
            text = rng.choice(spans)
            start = rng.randint(0, max(0, len(text) - 8))
            seg = text[start:start + rng.randint(8, max_len)]
        rows.append((seg + seg, [0] * len(seg) + [1] * len(seg)))
    return rows


def copy_loss(model, rows, pad_id: int) -> torch.Tensor:
    """Token-mean cross-entropy of the masked (second-copy) tokens of `rows`."""
    device = next(model.parameters()).device
    T = max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    att = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, (x, m) in enumerate(rows):
        ids[i, :len(x)], att[i, :len(x)], mask[i, :len(m)] = torch.tensor(x), 1, torch.tensor(m, dtype=torch.float)
    ids, att, mask = ids.to(device), att.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return -(lp * m).sum() / m.sum()


def copy_pretrain(model, tokenizer, texts: list[str], steps: int, lr: float = 1e-3, batch_size: int = 32,
                  max_len: int = 48, seed: int = 0, progress: bool = True) -> list[float]:
    """Teach a fresh model to copy from its context before it sees any game: every sequence is shown
    twice and the loss is on the second copy, which the model can only predict by finding the first copy
    and reading on (an induction head). Half the sequences are random tokens, half spans of `texts`.
    AdamW at a constant `lr`. Returns the loss of every step (before its update).

    Why: a tiny model behaviour-cloned on expert games learns the action format but not to copy a
    recipe line or an object's name from the observation, and both games need that; see the README."""
    assert steps > 0 and texts, "copy_pretrain needs steps > 0 and some text"
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    spans = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts if len(t) > 20]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="copy pre-training", disable=not progress, dynamic_ncols=True)
    for i in bar:
        loss = copy_loss(model, copy_batch(rng, vocab, spans, batch_size, max_len), pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if i % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return losses


# ---------------------------------------------------------------- the built-in warm start
# train.py and eval.py without --model start from the tiny model after up to three stages:
# 1. copy pre-training (`copy_steps` steps of copy_pretrain on random tokens and the env's own text), so
#    that the model can copy from its context;
# 2. behavioural cloning on the env's expert over the training split, with a share `noise` of the
#    expert's actions swapped for plausible wrong ones. The model learns the action format and is right
#    most of the time. With `thoughts`, the expert's replies think aloud first (env.expert_thought;
#    TextCraft: the listed recipes from the goal down to the item the action gets or crafts), which the
#    model learns to copy from the list; a swapped-in wrong action thinks only `I will <action>.`.
# 3. with `guess`: a bad habit, for RL to unlearn. `guess_epochs` more epochs of cloning at `guess_lr`,
#    on the same expert episodes plus a guesser's (expert_trajectories' `guess`: a share `guess` of the
#    episodes, each `guess_turns` turns of wrong actions under GUESS_THOUGHT, or of `guess_action`
#    under STALL_THOUGHT). The model then starts about that share of its episodes by guessing, and
#    keeps guessing as long as the guesser did; in TextCraft an episode that plays instead wins as often
#    as after stage 2. RL has to find that out: that is the room it gets. BabyAI's habit stalls: its
#    model drops fresh guesses a few turns after the guesser's end and then plays on, so they cost
#    little; the stall holds, but also takes over some episodes that open by playing (README).
# Changing a recipe changes the cache folder's name (a fresh build; stage 1 and stage 2 have their own
# folders, see copy_stage and guess_stage). `tasks`: how many training tasks, spread over the split (0:
# all). Times and results on 2 cores: README, "The main command on a laptop".
WARM_START = {
    "textcraft": dict(copy_steps=1500, tasks=0, noise=0.2, epochs=10, lr=3e-3, batch_size=8, thoughts=True,
                      guess=0.75, guess_turns=3, guess_epochs=1, guess_lr=1e-3),
    "babyai": dict(copy_steps=1500, tasks=200, noise=0.2, epochs=6, lr=3e-3, batch_size=8,
                   guess=0.85, guess_turns=15, guess_action="check available actions", guess_epochs=1, guess_lr=1e-3),
}
GUESS_KEYS = ("guess", "guess_turns", "guess_action", "guess_epochs", "guess_lr")  # stage 3's part of a recipe


def copy_stage(env: str, base: str, out: str, steps: int, seed: int = 0) -> dict:
    """Stage 1 alone: the model folder `base` after `steps` steps of copy_pretrain on random tokens and
    the env's text, saved into `out` with copy_stage.json (its loss every 50 steps and the last). It
    does not depend on the rest of the recipe, so train.py caches it apart (a new SFT recipe reuses it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tiny_model

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    losses = copy_pretrain(model, tokenizer, tiny_model.corpus((env,), tasks_per_env=200), steps, seed=seed)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"env": env, "base": base, "copy_steps": steps, "seed": seed, "time_s": time.time() - t0,
            "copy_loss": [round(x, 4) for x in losses[::50]] + [round(x, 4) for x in losses[-1:]]}
    with open(os.path.join(out, "copy_stage.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def warm_start(env: str, base: str, out: str, seed: int = 0) -> dict:
    """Stage 2 of WARM_START[env] into `out`, from `base`: copy_stage()'s folder when the recipe has
    copy_steps (train.default_model_path builds and caches it first), else the fresh tiny model."""
    recipe = {k: v for k, v in WARM_START[env].items() if k not in GUESS_KEYS}
    stage1 = os.path.join(base, "copy_stage.json")
    copied = json.load(open(stage1)) if os.path.exists(stage1) else {"copy_steps": 0, "copy_loss": []}
    if copied["copy_steps"] != recipe.get("copy_steps", 0):
        raise ValueError(f"{base} is the model after {copied['copy_steps']} copy steps; the {env} warm start "
                         f"needs {recipe.get('copy_steps', 0)} (sft.copy_stage)")
    info = clone_stage(env, base, out, recipe, recipe["epochs"], recipe["lr"], seed=seed)
    info["copy_loss"] = copied["copy_loss"]
    with open(os.path.join(out, "warm_start.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def guess_stage(env: str, base: str, out: str, seed: int = 0) -> dict:
    """Stage 3 of WARM_START[env] (its `guess` part) into `out`, from warm_start()'s folder `base`:
    guess_stage.json records the loss and the guesser's share of the data."""
    recipe = WARM_START[env]
    if not os.path.exists(os.path.join(base, "warm_start.json")):
        raise ValueError(f"{base} has no warm_start.json: stage 3 starts from sft.warm_start's model")
    info = clone_stage(env, base, out, recipe, recipe["guess_epochs"], recipe["guess_lr"], seed=seed,
                       guess=recipe["guess"], guess_turns=recipe["guess_turns"],
                       guess_action=recipe.get("guess_action"))
    with open(os.path.join(out, "guess_stage.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def clone_stage(env: str, base: str, out: str, recipe: dict, epochs: int, lr: float, seed: int = 0,
                **guesser) -> dict:
    """`epochs` of sft() at `lr` on expert_trajectories() over the recipe's training tasks (its noise
    and thoughts, plus `guesser`'s keywords), from the model folder `base`, saved into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from env_server import get_env_class

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    cls = get_env_class(env)
    ids = spread(cls.splits(cls.load_world(None))["train"], recipe["tasks"])
    data = expert_trajectories(env, ids, ChatFormat(tokenizer), recipe["noise"], seed,
                               thoughts=recipe.get("thoughts", False), **guesser)
    losses = sft(model, tokenizer, data, epochs, lr, batch_size=recipe["batch_size"], seed=seed)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    guessed = sum(opens_by_guessing(t.messages) for t in data)
    return {"env": env, "base": base, "recipe": recipe, "tasks": len(ids), "trajectories": len(data),
            "guesser_share": guessed / len(data), "sft_loss": losses,
            "expert_success": sum(map(is_success, data)) / len(data), "time_s": time.time() - t0}


# ---------------------------------------------------------------- AgentEvol
def play(model, tokenizer, env_addr: str, env_name: str, item_ids: list[int], rcfg: RolloutConfig,
         generator: torch.Generator | None = None, pool_size: int = 64) -> list[Trajectory]:
    """rollout() over `item_ids` on at most `pool_size` env instances at once."""
    from eval import play_in_chunks

    fmt = ChatFormat(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.eot_id
    engine = HFEngine(model, pad_id)
    def play_chunk(pool, items, groups):
        return rollout(engine, fmt, pool, env_name, items, groups, rcfg, generator)

    return play_in_chunks(env_addr, pool_size, item_ids, list(range(len(item_ids))), play_chunk, desc="play",
                          leave=False)


def agent_evol(model, tokenizer, env_addr: str, env_name: str, train_ids: list[int], iterations: int = 2,
               samples_per_task: int = 2, data: list[Trajectory] | None = None, epochs: int = 1, lr: float = 1e-4,
               max_turns: int = 10, max_new_tokens: int = 64, temperature: float = 1.0,
               micro_batch_tokens: int = 8192, seed: int = 0, progress: bool = True) -> list[float]:
    """AgentEvol: each iteration samples `samples_per_task` trajectories per training task with the
    current model, keeps the successes (status done, reward > 0), and fine-tunes on them plus all earlier
    data (`data`: e.g. the expert trajectories of the warm start). Returns each iteration's success rate
    (over trajectories without env errors), measured before that iteration's fine-tuning."""
    data = list(data or [])
    rcfg = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, temperature=temperature)
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)  # where HFEngine samples
    rates = []
    for it in range(iterations):
        items = [i for i in train_ids for _ in range(samples_per_task)]
        trajs = [t for t in play(model, tokenizer, env_addr, env_name, items, rcfg, gen) if t.status != "env_error"]
        wins = [t for t in trajs if is_success(t)]
        rates.append(len(wins) / max(1, len(trajs)))
        data += wins
        if progress:
            print(f"agentevol iteration {it + 1}/{iterations}: success {rates[-1]:.3f}, {len(data)} trajectories")
        if data:
            sft(model, tokenizer, data, epochs=epochs, lr=lr, micro_batch_tokens=micro_batch_tokens, seed=seed + it,
                progress=progress)
    return rates


# ---------------------------------------------------------------- DPO
def make_pairs(trajectories: list[Trajectory], seed: int = 0) -> list[tuple[Trajectory, Trajectory]]:
    """(chosen, rejected) pairs within each item_id: a success against a failure. Every success and every
    failure of a task is used at least once (the shorter list is cycled). Env errors are never used."""
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
        pairs += [(wins[i % len(wins)], losses[i % len(losses)]) for i in range(max(len(wins), len(losses)))]
    return pairs


def sequence_logprobs(model, batch: dict, idx: list[int], device) -> torch.Tensor:
    """log pi(trajectory) = sum of the log-probs of its loss_mask = 1 tokens, for rows idx: (b,)."""
    mb = _rows(batch, idx, device)
    m = mb["loss_mask"][:, 1:]
    lp, _ = token_logprobs(model, mb, temperature=1.0, mask=m)  # (b, T-1), 0 where m = 0
    return torch.where(m > 0, lp, 0.0).sum(-1)


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), mean over pairs."""
    return -torch.nn.functional.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))).mean()


def dpo(model, ref_model, tokenizer, pairs: list[tuple[Trajectory, Trajectory]], beta: float = 0.1,
        lr: float = 1e-5, epochs: int = 1, batch_size: int = 8, micro_batch_tokens: int = 8192,
        max_grad_norm: float = 1.0, seed: int = 0, progress: bool = True) -> list[float]:
    """Multi-turn DPO over (chosen, rejected) trajectory pairs; returns the loss of every optimizer step
    (measured before its update). A micro-batch holds whole pairs, since the loss couples both rows."""
    assert pairs, "dpo needs at least one (chosen, rejected) pair"
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [t for pair in pairs for t in pair]  # chosen of pair k at 2k, rejected at 2k+1
    batch = build_batch(rows, pad_id)
    lengths = batch["attention_mask"].sum(-1).tolist()
    ref_model.eval()
    with torch.no_grad():  # the reference never changes: score every row once
        ref = torch.cat([sequence_logprobs(ref_model, batch, [2 * k, 2 * k + 1], device) for k in range(len(pairs))])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    step_losses = []
    bar = tqdm(total=epochs * -(-len(pairs) // batch_size), desc="dpo", disable=not progress, dynamic_ncols=True)
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
                loss = dpo_loss(pi[0::2], pi[1::2], ref[idx][0::2].to(device), ref[idx][1::2].to(device), beta)
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
class Config:
    env: str = arg("textcraft", "environment: textcraft, babyai, corridor")
    mode: str = arg("sft", "training paradigm", choices=["sft", "agentevol", "dpo"])
    model: str | None = arg(None, "HF model folder or hub name; absent: the built-in tiny model")
    out: str | None = arg(None, "folder for the fine-tuned model (an HF folder: model + tokenizer)")
    tasks: str = arg("train", "task ids: a split name (train, test), 'all', or ids such as 0,1,5-9")
    from_log: str | None = arg(None, "train on a trajectory log (step_*.jsonl or a folder) instead of the expert")
    success_only: bool = arg(False, "with --from-log in sft mode: keep only successful trajectories")
    noise: float = arg(0.0, "probability of replacing an expert action by a plausible wrong one")
    guess: float = arg(0.0, "share of the expert data played by a guesser (GUESS_THOUGHT over wrong actions): "
                            "a bad habit for RL to unlearn; the built-in warm start's stage 3")
    guess_turns: int = arg(3, "turns per guesser episode")
    guess_action: str | None = arg(None, "the guesser stalls: every reply takes this action under STALL_THOUGHT "
                                         "(e.g. 'check available actions') instead of a fresh wrong one")
    plain_thoughts: bool = arg(False, "expert replies think only 'I will <action>.', not the env's reasoning "
                                      "(TextCraft: the recipes from the goal down to the action)")
    max_turns: int = arg(30, "turns per expert trajectory or sampled episode")
    epochs: int = arg(3, "passes over the data (per iteration in agentevol)")
    lr: float = arg(1e-3, "AdamW learning rate (~1e-5 for 3B-7B models; DPO wants less than SFT)")
    batch_size: int = arg(16, "trajectories (DPO: pairs) per optimizer step")
    micro_batch_tokens: int = arg(8192, "padded tokens per forward/backward pass")
    iterations: int = arg(2, "agentevol: sample-filter-finetune rounds")
    samples_per_task: int = arg(2, "agentevol/dpo: trajectories sampled per task")
    max_new_tokens: int = arg(64, "agentevol/dpo: tokens per sampled turn")
    temperature: float = arg(1.0, "agentevol/dpo: sampling temperature")
    beta: float = arg(0.1, "dpo: inverse temperature of the implicit reward")
    env_addr: str | None = arg(None, "agentevol/dpo: URL of a running env server; absent: start one")
    seed: int = arg(0, "seed of noise, data order and sampling")
    threads: int = arg(0, "CPU threads for torch (0: all cores but one)")
    cache_dir: str = arg(os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"),
                         "where the built-in tiny model is built once")


def parse_args(argv=None) -> Config:
    p = config_parser(Config, __doc__)
    cfg = Config(**vars(p.parse_args(argv)))
    if not cfg.out:
        p.error("--out is required: the folder the fine-tuned model is saved to")
    check_positive(p, cfg, ("epochs", "batch_size", "micro_batch_tokens", "iterations", "samples_per_task",
                            "max_turns", "max_new_tokens", "guess_turns"))
    if not 0.0 <= cfg.noise <= 1.0:
        p.error(f"--noise must be a probability in [0, 1], got {cfg.noise}")
    if not 0.0 <= cfg.guess < 1.0:
        p.error(f"--guess must be a share in [0, 1), got {cfg.guess}")
    if cfg.guess_action and not cfg.guess:
        p.error("--guess-action says what the guesser does: give the guesser a share with --guess")
    if cfg.from_log and not os.path.exists(cfg.from_log):
        p.error(f"--from-log: {cfg.from_log} does not exist")
    if cfg.model and os.path.sep in cfg.model and not os.path.isdir(cfg.model):
        p.error(f"--model: {cfg.model} is not a folder")
    from env_server import ENVS
    if cfg.env not in ENVS:
        p.error(f"--env: unknown environment {cfg.env!r}; choose from {sorted(ENVS)}")
    try:
        cfg_task_ids(cfg)
    except ValueError as e:
        p.error(f"--tasks: {e}")
    return cfg


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
            raise ValueError(f"{cfg.tasks!r} is not a split ({', '.join(sorted(splits))}), 'all' or ids like 0,3,5-9")
        ids += list(range(int(lo), int(hi or lo) + 1))
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"task ids {bad[:5]} out of range 0..{n - 1} for {cfg.env}")
    return ids


def main(cfg: Config) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train import tiny_model_path

    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) - 1))
    torch.manual_seed(cfg.seed)
    path = cfg.model or tiny_model_path(cfg.env, cfg.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to("cuda" if torch.cuda.is_available() else "cpu")
    fmt = ChatFormat(tokenizer)
    ids = cfg_task_ids(cfg)
    kw = dict(lr=cfg.lr, micro_batch_tokens=cfg.micro_batch_tokens, seed=cfg.seed)
    if cfg.from_log:
        data = load_log(cfg.from_log, successful_only=cfg.success_only and cfg.mode == "sft")
        if not data:
            sys.exit(f"--from-log: no usable trajectories in {cfg.from_log}")
    else:
        data = expert_trajectories(cfg.env, ids, fmt, cfg.noise, cfg.seed, cfg.max_turns,
                                   thoughts=not cfg.plain_thoughts, guess=cfg.guess, guess_turns=cfg.guess_turns,
                                   guess_action=cfg.guess_action)
    summary: dict = {"mode": cfg.mode, "model": path, "trajectories": len(data),
                     "expert_success": sum(map(is_success, data)) / len(data)}

    server = None
    if cfg.mode != "sft" and cfg.env_addr is None:
        from env_server.app import ServerProcess
        server = ServerProcess(cfg.env)
    url = cfg.env_addr or (server.url if server else None)
    try:
        if cfg.mode == "sft":
            summary["sft_loss"] = sft(model, tokenizer, data, cfg.epochs, batch_size=cfg.batch_size, **kw)
        elif cfg.mode == "agentevol":  # behavioural cloning on the data first, then self-evolution
            summary["sft_loss"] = sft(model, tokenizer, data, cfg.epochs, batch_size=cfg.batch_size, **kw)
            summary["success_rate"] = agent_evol(
                model, tokenizer, url, cfg.env, ids, cfg.iterations, cfg.samples_per_task, data, cfg.epochs,
                max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, **kw)
        else:
            pool = data
            if not cfg.from_log:  # the model's own samples as rejected, the expert's as chosen
                rcfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                                     temperature=cfg.temperature)
                items = [i for i in ids for _ in range(cfg.samples_per_task)]
                pool = data + play(model, tokenizer, url, cfg.env, items, rcfg,
                                           torch.Generator(next(model.parameters()).device).manual_seed(cfg.seed))
            pairs = make_pairs(pool, cfg.seed)
            if not pairs:
                sys.exit("dpo: no task has both a successful and a failed trajectory to pair")
            ref = copy.deepcopy(model).eval()
            summary["pairs"] = len(pairs)
            summary["dpo_loss"] = dpo(model, ref, tokenizer, pairs, cfg.beta, epochs=cfg.epochs,
                                      batch_size=cfg.batch_size, **kw)
    finally:
        if server is not None:
            server.stop()
    os.makedirs(cfg.out, exist_ok=True)
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    with open(os.path.join(cfg.out, "sft_summary.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **summary}, f, indent=2)
    return summary


if __name__ == "__main__":
    out = main(parse_args())
    print(json.dumps({k: ([round(x, 4) for x in v] if isinstance(v, list) else v) for k, v in out.items()}))
