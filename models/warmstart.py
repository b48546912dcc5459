"""The built-in warm start: expert demonstrations, behavioural cloning, copy pre-training, the
recipes.

A model that cannot yet play gets nothing from RL (no episode is ever won), so train.py and
eval.py, run without --model, start from a tiny model warm-started per env (WARM_START), built
once and cached stage by stage (models.default_model_path):

1. copy pre-training (`copy_pretrain`): sequences shown twice, loss on the second copy, so
   that the model learns to copy from its context (a recipe line, an object's name) before it
   sees a game;
2. behavioural cloning (`sft`) on the env's expert over the training split
   (`expert_trajectories`), with a share `noise` of the expert's actions swapped for plausible
   wrong ones. With `thoughts` the expert thinks aloud first (TextCraft: the listed recipes
   from the goal down to the item). With `mover="random"` (Corridor) on a random policy
   instead (rollout.RandomPolicy): the form of a move, none of the expert's;
3. with `guess`: a habit planted on purpose. One more epoch of cloning on the expert's
   episodes plus a guesser's (a share `guess` of the data, `guess_turns` turns of wrong
   actions under GUESS_THOUGHT, or of `guess_action` under STALL_THOUGHT). The model then
   opens about that share of its episodes with the habit. What RL gains from this start is
   mostly the habit unlearned: held-out success returns to the level of the stage-2 model, not
   beyond it (docs/results.md).

Expert trajectories are played by rollout.rollout itself, with `ExpertPolicy` writing the
replies and `LocalPool` stepping the games in this process: the rows have exactly the token
boundaries the model later samples on (reply ids + end-of-turn with loss mask 1, observation
turns with loss mask 0).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

from algos import INPUTS
from distributed import Precision, build_batch, length_buckets
from env_server.agents import GUESS_THOUGHT, STALL_THOUGHT, opens_by_guessing, react_reply
from env_client import Step
from models.policy import load_model, load_tokenizer, pad_id, token_logprobs
from rollout import (ChatFormat, RandomPolicy, Reply, RolloutConfig, Trajectory, is_success,
                     rollout)
from tasks import spread


# ---------------------------------------------------------------- expert data
class LocalPool:
    """env_client.EnvPool's interface (reset, step, close) over games in this process, no
    server: the expert reads each game's state (`envs[i].expert_action()`) while it plays."""

    def __init__(self, env_cls, world, variants: list[int]):
        self.envs = [env_cls(world) for _ in variants]
        self.size, self.variants = len(variants), variants
        self.has_variants = "variant" in inspect.signature(env_cls.reset).parameters
        self.first: list[str | None] = [None] * self.size  # each game's first observation

    def reset(self, item_ids: list[int | None]) -> list[str | None]:
        for i, item in enumerate(item_ids):
            if item is not None:
                variant = {"variant": self.variants[i]} if self.has_variants else {}
                self.first[i] = self.envs[i].reset(item, **variant)
        return [self.first[i] if item is not None else None
                for i, item in enumerate(item_ids)]

    def step(self, actions: list[str | None]) -> list[Step | None]:
        out: list[Step | None] = []
        for env, action in zip(self.envs, actions):
            if action is None:
                out.append(None)
                continue
            r = env.step(action)
            # as the client reports
            reward = r.score if r.score is not None else r.reward
            out.append(Step(r.observation, reward, r.done))
        return out

    def close(self) -> None:
        for env in self.envs:
            env.close()


def wrong_action(env, first_observation: str, expert: str, rng: random.Random) -> str | None:
    """A plausible but wrong action: another concrete action the env lists, a crafting command
    from the task's own list (TextCraft), or `inventory`. None when there is nothing else to
    say."""
    # drop templates ("get N item")
    listed = [a for a in env.available_actions() if " N " not in f" {a} "]
    crafts = [ln.strip() for ln in first_observation.splitlines() if ln.startswith("craft ")]
    extra = ["inventory"] if getattr(env, "name", "") == "textcraft" else []
    candidates = sorted({a for a in listed + crafts + extra if a != expert})
    return rng.choice(candidates) if candidates else None


class ExpertPolicy:
    """Replies written for the games of a LocalPool: the expert's action
    (`env.expert_action()`), with its thought where the env has one (`expert_thought`) and
    `thoughts` is on (`"checked"`: with its ingredients checked against the listed commands,
    where the env can), else `I will <action>.`. With probability `noise` the action is
    swapped for a plausible wrong one (wrong_action), which thinks only `I will <action>.`. As
    a `guesser` every reply thinks GUESS_THOUGHT over a wrong action, or, with `guess_action`,
    STALL_THOUGHT over that one action. Reply ids are what the policy would sample
    (fmt.reply_ids); log-probs are 0 (nothing was sampled). None: the expert has no move."""

    def __init__(self, pool: LocalPool, env_name: str, fmt: ChatFormat, rng: random.Random,
                 noise: float = 0.0, thoughts: bool | str = True, guesser: bool = False,
                 guess_action: str | None = None):
        self.pool, self.env_name, self.fmt, self.rng = pool, env_name, fmt, rng
        self.noise, self.thoughts = noise, thoughts
        self.guesser, self.guess_action = guesser, guess_action

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply | None]:
        return [self._reply(self.pool.envs[i], self.pool.first[i]) for i in slots]

    def _reply(self, env, first: str) -> Reply | None:
        stalls = self.guesser and self.guess_action is not None
        action = self.guess_action if stalls else env.expert_action()
        if action is None:  # the expert has nothing to say: the episode cannot go on
            return None
        if stalls:
            thought = STALL_THOUGHT
        elif self.guesser:
            action = wrong_action(env, first, action, self.rng) or action
            thought = GUESS_THOUGHT
        else:
            thought = None
            if self.thoughts and hasattr(env, "expert_thought"):
                # only envs that can check take the keyword
                checked = {"checked": True} if self.thoughts == "checked" else {}
                thought = env.expert_thought(action, **checked)
            if self.noise > 0 and self.rng.random() < self.noise:
                if wrong := wrong_action(env, first, action, self.rng):
                    action, thought = wrong, None
        text = react_reply(self.env_name, action, thought)
        ids = self.fmt.reply_ids(text)
        return Reply(text, ids, [0.0] * len(ids), True)


def expert_trajectories(env_name: str, item_ids: list[int], fmt: ChatFormat,
                        noise: float = 0.0, seed: int = 0, max_turns: int = 30,
                        variants: int = 1, thoughts: bool | str = True, guess: float = 0.0,
                        guess_turns: int = 3, guess_action: str | None = None,
                        progress: bool = True, won_only: bool = False,
                        mover: str = "expert") -> list[Trajectory]:
    """Play each task in-process with the env's expert (ExpertPolicy); one Trajectory per
    episode, by rollout.rollout, episode after episode (one random stream, in a fixed order).
    Status and reward as in any rollout: `done` with the step's reward, else `max_turns`. With
    `variants` v > 1, envs whose reset takes a `variant` (TextCraft: other distractors,
    another order) play every task in v versions.

    With `guess` g > 0 a guesser plays a share g of all the returned episodes (after the
    expert's, on the tasks in shuffled turn), each `guess_turns` turns long (ExpertPolicy's
    `guesser`): a model cloned on the mix opens an episode with the guesser's habit with
    probability about g. With `won_only` the expert's episodes it did not win are left out
    (BabyAI's bot loses about one in ten within 30 turns). With `mover` "random" the replies
    are rollout.RandomPolicy's instead of the expert's: moves in the game's form, each drawn
    without looking at the game (its noise, thoughts and guesser do not apply)."""
    from env_server import get_env_class

    assert 0.0 <= noise <= 1.0, f"noise is a probability, got {noise}"
    assert 0.0 <= guess < 1.0, (
        f"guess is the guesser's share of the data, in [0, 1), got {guess}")
    env_cls = get_env_class(env_name)
    world = env_cls.load_world(None)
    rng = random.Random(seed)
    if variants > 1 and "variant" not in inspect.signature(env_cls.reset).parameters:
        raise ValueError(f"{env_name} has no task variants: use more task ids instead of "
                         f"variants={variants}")
    episodes = [(i, v, False) for v in range(variants) for i in item_ids]
    n_guess = round(len(episodes) * guess / (1.0 - guess))
    order = []  # the guesser's tasks: whole shuffled passes over item_ids, as many as needed
    while len(order) < n_guess:
        order += rng.sample(item_ids, len(item_ids))
    episodes += [(item, 0, True) for item in order[:n_guess]]
    trajs = []
    bar = tqdm(episodes, desc=f"{env_name} demonstrations", disable=not progress, leave=False,
               dynamic_ncols=True)
    for group, (item, variant, guesser) in enumerate(bar):
        pool = LocalPool(env_cls, world, [variant])
        try:
            policy = (RandomPolicy(env_name, rng.randrange(1 << 30), fmt) if mover == "random"
                      else ExpertPolicy(pool, env_name, fmt, rng, noise, thoughts, guesser,
                                        guess_action))
            turns = guess_turns if guesser else max_turns
            cfg = RolloutConfig(max_turns=turns, max_context=1 << 30, check_template=False)
            played = rollout(policy, pool, env_name, [item], [group], cfg, fmt=fmt)
        finally:
            pool.close()
        trajs += [t for t in played if guesser or not won_only or is_success(t)]
    return trajs


# ---------------------------------------------------------------- SFT
def micro_rows(batch: dict, idx: list[int], device) -> dict:
    """Rows `idx` of a build_batch() batch on `device`, cut to their longest row."""
    T = int(batch["attention_mask"][idx].sum(-1).max())  # cut the micro-batch's padding
    return {k: batch[k][idx, :T].to(device) for k in (*INPUTS, "loss_mask")}


def warmup_cosine(i: int, total: int, warmup: float = 0.05) -> float:
    """Learning-rate factor at optimizer step i of `total`: linear warm-up over the first 5%,
    then a cosine decay to 10% of the peak."""
    w = max(1, int(total * warmup))
    if i < w:
        return (i + 1) / w
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (i - w) / max(1, total - w))))


def sft(model, tokenizer, trajectories: list[Trajectory], epochs: int = 3, lr: float = 1e-4,
        micro_batch_tokens: int = 8192, batch_size: int = 16, max_grad_norm: float = 1.0,
        weight_decay: float = 0.0, seed: int = 0, progress: bool = True,
        dtype: torch.dtype = torch.float32) -> list[float]:
    """Supervised fine-tuning: token-mean cross-entropy over the loss_mask = 1 tokens (the
    replies and their end-of-turn tokens), AdamW, `batch_size` trajectories per optimizer
    step, micro-batched by length, with a warm-up + cosine learning-rate schedule. `model`
    holds fp32 weights; with `dtype` bf16 the forward and backward run on a bf16 copy
    (distributed.Precision). Returns the mean loss of each epoch (measured on the fly,
    before each step's update)."""
    assert trajectories, "sft needs at least one trajectory"
    device = next(model.parameters()).device
    batch = build_batch(trajectories, pad_id(tokenizer))
    mask = batch["loss_mask"][:, 1:]  # (B, T-1): token t+1 is predicted from the logits at t
    lengths = batch["attention_mask"].sum(-1).tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rng = random.Random(seed)
    model.train()
    prec = Precision(model, dtype)
    B = len(trajectories)
    total = epochs * -(-B // batch_size)  # optimizer steps in all
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: warmup_cosine(i, total))
    losses = []
    bar = tqdm(total=total, desc="sft", unit="step", disable=not progress, dynamic_ncols=True)
    for epoch in range(epochs):
        perm = list(range(B))
        rng.shuffle(perm)
        nll_sum, tok_sum = 0.0, 0.0
        for s in range(0, B, batch_size):
            mini = perm[s:s + batch_size]
            n_tokens = float(mask[mini].sum().clamp(min=1))
            opt.zero_grad(set_to_none=True)
            for idx_local in length_buckets([lengths[i] for i in mini], micro_batch_tokens):
                idx = [mini[i] for i in idx_local]
                mb = micro_rows(batch, idx, device)
                m = mb["loss_mask"][:, 1:]
                # (b, T-1), 0 where m = 0
                lp, _ = token_logprobs(prec.model, mb, temperature=1.0, mask=m)
                nll = -(torch.where(m > 0, lp, 0.0)).sum()
                # the micro-batches add up to the mini-batch's token mean
                (nll / n_tokens).backward()
                prec.collect_grads()
                nll_sum, tok_sum = nll_sum + float(nll.detach()), tok_sum + float(m.sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            prec.sync()
            sched.step()
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{nll_sum / max(tok_sum, 1.0):.4f}")
        losses.append(nll_sum / max(tok_sum, 1.0))
    bar.close()
    return losses


# ---------------------------------------------------------------- copy pre-training
def copy_batch(rng: random.Random, vocab: list[int], spans: list[list[int]], batch_size: int,
               max_len: int):
    """`batch_size` sequences shown twice, `seg + seg`, with a loss mask on the second copy
    only. Even rows are random tokens from `vocab`, odd rows spans of `spans` (env text); each
    segment has 8 to `max_len` tokens. Returns lists of (ids, mask)."""
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


def copy_loss(model, rows, pad: int) -> torch.Tensor:
    """Token-mean cross-entropy of the masked (second-copy) tokens of `rows`."""
    device = next(model.parameters()).device
    T = max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    att = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, (x, m) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        att[i, :len(x)] = 1
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    ids, att, mask = ids.to(device), att.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return -(lp * m).sum() / m.sum()


def copy_pretrain(model, tokenizer, texts: list[str], steps: int, lr: float = 1e-3,
                  batch_size: int = 32, max_len: int = 48, seed: int = 0,
                  progress: bool = True) -> list[float]:
    """Teach a fresh model to copy from its context before it sees any game: every sequence is
    shown twice and the loss is on the second copy, which the model can only predict by
    finding the first copy and reading on (an induction head). Half the sequences are random
    tokens, half spans of `texts`. AdamW at a constant `lr`. Returns the loss of every step
    (before its update).

    Why: a tiny model behaviour-cloned on expert games learns the action format but not to
    copy a recipe line or an object's name from the observation, and both games need that
    (docs/results.md)."""
    assert steps > 0 and texts, "copy_pretrain needs steps > 0 and some text"
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    spans = [tokenizer(t, add_special_tokens=False)["input_ids"]
             for t in texts if len(t) > 20]
    pad = pad_id(tokenizer)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="copy pre-training", disable=not progress,
               dynamic_ncols=True)
    for i in bar:
        loss = copy_loss(model, copy_batch(rng, vocab, spans, batch_size, max_len), pad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if i % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return losses


# ---------------------------------------------------------------- the recipes
# The stages are the module docstring's. Changing a recipe changes its cache folder's name, so
# it is built afresh (stage 1 and stage 3 have folders of their own: copy_stage, guess_stage).
# `tasks`: how many training tasks, spread over the split (0: all). Build times and results on
# 2 cores: docs/results.md.
WARM_START = {
    # Corridor's start knows the form of a move and nothing of the game: it clones a random
    # mover (one word a reply, left or right at random, whatever the observation says), so it
    # starts at chance and everything above that is RL's
    "corridor": dict(mover="random", tasks=0, noise=0.0, epochs=8, lr=3e-3, batch_size=8),
    "doors": dict(mover="random", tasks=0, noise=0.0, epochs=8, lr=3e-3, batch_size=8),
    "textcraft": dict(copy_steps=1500, tasks=0, noise=0.2, epochs=10, lr=3e-3, batch_size=8,
                      thoughts=True,
                      guess=0.75, guess_turns=3, guess_epochs=1, guess_lr=1e-3),
    "babyai": dict(copy_steps=1500, tasks=200, noise=0.2, epochs=6, lr=3e-3, batch_size=8,
                   guess=0.85, guess_turns=15, guess_action="check available actions",
                   guess_epochs=1, guess_lr=1e-3),
}
# stage 3's part of a recipe
GUESS_KEYS = ("guess", "guess_turns", "guess_action", "guess_epochs", "guess_lr")

# The SFT warm start of a built-in real model (`--model NAME-sft`, models.builtin_warm_path),
# per env: stage 2 alone, on the clean expert (no noise, no habit), in the compute dtype of
# `--dtype auto`. TextCraft's is the recipe measured on SmolLM2-135M-Instruct
# (docs/real_model.md): all 420 training tasks, 1 epoch, lr 1e-4, 16 trajectories per step.
# BabyAI's is the same recipe on half its 800 training tasks, spread over the 40 levels (10
# each: an even spread of its ids would hold only the even levels, recipe_tasks): the same
# number of steps (25 of 16) as TextCraft's, each episode a little longer (9.7 expert turns);
# only the episodes the expert won (`won_only`: its bot loses about 1 in 10 of them within 30
# turns, wandering).
REAL_WARM_START = {
    "textcraft": dict(tasks=0, noise=0.0, epochs=1, lr=1e-4, batch_size=16, thoughts=True),
    "babyai": dict(tasks=400, by_category=True, noise=0.0, epochs=1, lr=1e-4, batch_size=16,
                   won_only=True),
}


def copy_stage(env: str, base: str, out: str, steps: int, seed: int = 0) -> dict:
    """Stage 1 alone: the model folder `base` after `steps` steps of copy_pretrain on random
    tokens and the env's text, saved into `out` with copy_stage.json (its loss every 50 steps
    and the last). It does not depend on the rest of the recipe, so models/builtin.py caches
    it apart (a new SFT recipe reuses it)."""
    import models.tiny as tiny_model

    t0 = time.time()
    tokenizer, model = load_tokenizer(base), load_model(base)
    texts = tiny_model.corpus((env,), tasks_per_env=200)
    losses = copy_pretrain(model, tokenizer, texts, steps, seed=seed)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    curve = [round(x, 4) for x in losses[::50] + losses[-1:]]  # every 50 steps, and the last
    info = {"env": env, "base": base, "copy_steps": steps, "seed": seed,
            "time_s": time.time() - t0, "copy_loss": curve}
    with open(os.path.join(out, "copy_stage.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def warm_start(env: str, base: str, out: str, seed: int = 0) -> dict:
    """Stage 2 of WARM_START[env] into `out`, from `base`: copy_stage()'s folder when the
    recipe has copy_steps (models.default_model_path builds and caches it first), else the
    fresh tiny model."""
    recipe = {k: v for k, v in WARM_START[env].items() if k not in GUESS_KEYS}
    stage1 = os.path.join(base, "copy_stage.json")
    copied = (json.load(open(stage1)) if os.path.exists(stage1)
              else {"copy_steps": 0, "copy_loss": []})
    steps = recipe.get("copy_steps", 0)
    if copied["copy_steps"] != steps:
        raise ValueError(f"{base} is the model after {copied['copy_steps']} copy steps; "
                         f"the {env} warm start needs {steps} (copy_stage)")
    info = clone_stage(env, base, out, recipe, recipe["epochs"], recipe["lr"], seed=seed)
    info["copy_loss"] = copied["copy_loss"]
    with open(os.path.join(out, "warm_start.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def real_warm_start(env: str, base: str, out: str, recipe: dict, seed: int = 0) -> dict:
    """A real model's SFT warm start (a REAL_WARM_START recipe) from the folder `base` into
    `out`, on the GPU where there is one, in bf16 where the hardware has it
    (policy.resolve_dtype); real_warm_start.json records the recipe, the losses and the
    time."""
    from models.policy import resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = clone_stage(env, base, out, recipe, recipe["epochs"], recipe["lr"], seed=seed,
                       device=device, dtype=resolve_dtype("auto", device))
    with open(os.path.join(out, "real_warm_start.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def guess_stage(env: str, base: str, out: str, seed: int = 0) -> dict:
    """Stage 3 of WARM_START[env] (its `guess` part) into `out`, from warm_start()'s folder
    `base`: guess_stage.json records the loss and the guesser's share of the data."""
    recipe = WARM_START[env]
    if not os.path.exists(os.path.join(base, "warm_start.json")):
        raise ValueError(f"{base} has no warm_start.json: stage 3 starts from "
                         "warm_start's model")
    info = clone_stage(env, base, out, recipe, recipe["guess_epochs"], recipe["guess_lr"],
                       seed=seed, guess=recipe["guess"], guess_turns=recipe["guess_turns"],
                       guess_action=recipe.get("guess_action"))
    with open(os.path.join(out, "guess_stage.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def recipe_tasks(env: str, recipe: dict) -> list[int]:
    """The recipe's `tasks` training tasks (0: all), spread evenly over the split; with
    `by_category`, spread evenly within each of the env's task categories, in shares as equal
    as the split allows. An even spread keeps every k-th task, which can miss a structure of
    the ids: BabyAI's id i is level i % 40 + 1, so 400 of its 800 training tasks spread evenly
    are the even ids, 20 of the 40 levels."""
    from env_server import get_env_class

    cls = get_env_class(env)
    world = cls.load_world(None)
    train, k = cls.splits(world)["train"], recipe["tasks"]
    if not recipe.get("by_category") or not k or k >= len(train):
        return spread(train, k)
    groups: dict[str, list[int]] = {}
    for t in train:
        groups.setdefault(cls.task_category(world, t), []).append(t)
    share = {c: 0 for c in groups}
    for _ in range(k):  # one more to the category whose share is smallest against its size
        c = min((c for c in groups if share[c] < len(groups[c])),
                key=lambda c: (share[c] / len(groups[c]), c))
        share[c] += 1
    return sorted(t for c, ids in groups.items() if share[c] for t in spread(ids, share[c]))


def clone_stage(env: str, base: str, out: str, recipe: dict, epochs: int, lr: float,
                seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32,
                **guesser) -> dict:
    """`epochs` of sft() at `lr` on expert_trajectories() over the recipe's training tasks
    (its noise and thoughts, plus `guesser`'s keywords), from the model folder `base`, saved
    into `out`; the model on `device`, computing in `dtype` (fp32 master weights either
    way)."""
    t0 = time.time()
    tokenizer, model = load_tokenizer(base), load_model(base, device)
    ids = recipe_tasks(env, recipe)
    data = expert_trajectories(env, ids, ChatFormat(tokenizer), recipe["noise"], seed,
                               thoughts=recipe.get("thoughts", False),
                               won_only=recipe.get("won_only", False),
                               mover=recipe.get("mover", "expert"), **guesser)
    losses = sft(model, tokenizer, data, epochs, lr, batch_size=recipe["batch_size"],
                 seed=seed, dtype=dtype)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n = len(data)
    guessed = sum(opens_by_guessing(t.messages) for t in data)
    won = sum(map(is_success, data))
    return {"env": env, "base": base, "recipe": recipe, "tasks": len(ids), "trajectories": n,
            "guesser_share": guessed / n, "sft_loss": losses, "expert_success": won / n,
            "time_s": time.time() - t0}


