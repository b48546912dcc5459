"""Multi-turn rollouts, token in / token out.

One trajectory = one env instance playing one task for up to K assistant turns. All unfinished
trajectories reply together, then their envs step together (one batched HTTP call), then each
observation is appended. The row of token ids of a trajectory is built by appending, never re-encoding:

    prompt ids (chat template of the opening messages, with the generation prompt)     loss mask 0
    + sampled ids of turn 1, ending with the end-of-turn token (sampler log-probs kept) loss mask 1
    + observation ids (the chat template's rendering of the user turn)                   loss mask 0
    + sampled ids of turn 2 ... and so on.

So the ids trained on are exactly the ids the sampler produced and saw. Every turn the row is checked
against the chat template of the messages so far: equal ids (the usual case), or equal text with a
different but valid tokenization of sampled text (`noncanonical`), or different text (`mismatch`): a
template that rewrites history (Qwen3 drops earlier <think> blocks; `ChatFormat.prefix_preserving` tells
in advance), or a tokenizer whose decode/encode is not an exact round trip. A mismatch is reported
loudly and counted; the row still holds what the policy saw, which is what it is trained on.

Who replies is a policy with one method, `replies(trajectories, slots) -> [Reply]`: `EnginePolicy`
samples token ids from a generation engine (engines.py); eval.py's chat endpoint and warmstart.py's
expert write text. The same loop (`rollout`) plays all of them, so prompts, parsing, statuses and rows
are the same for training, evaluation and demonstrations.

A trajectory's reward is the env's latest step value on the trainer's 0-1 scale (`env_client.train_reward`:
SciWorld's server scores 0-100, as AgentGym's does, and is divided by 100 here).

Statuses: done, max_turns, context_limit, env_error. An env error drops the trajectory from the loss;
it is never scored as 0. Success, wherever it is counted, is `is_success`: done with a reward above 0.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass

import torch

from agents import Move, make_agent, opens_by_guessing
from env_client import EnvError, EnvPool, train_reward


# ---------------------------------------------------------------- chat template, as token deltas
class ChatFormat:
    """What to append after a sampled reply, read off the tokenizer's own chat template.

    The template is rendered on a fixed dummy conversation [user U, assistant A, user OBS] and the
    text after "A" is the observation turn: the end-of-turn marker, the user turn, the generation
    prompt. Its first token is the end-of-turn token the policy samples to end its reply.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use an instruct/chat model's tokenizer")
        self.tok = tokenizer
        anchor = self.encode(self._after_reply("x"))
        first = anchor[0] if anchor else None
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        # The end-of-turn token: the first token after the reply if it is a special token (<|im_end|>,
        # <|end|>); otherwise replies end at the tokenizer's eos.
        self.eot_id = first if first in special else tokenizer.eos_token_id
        self.stop_ids = sorted({i for i in (self.eot_id, tokenizer.eos_token_id) if i is not None})
        self.eot_is_anchor = first in special
        self.prefix_preserving = self._check_prefix_preserving()

    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Sampled ids as the reply text the env and the logs see (special tokens kept as written)."""
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _after_reply(self, observation: str) -> str:
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        head = self._render(base[:1], gen=True) + "A"
        full = self._render(base + [{"role": "user", "content": observation}], gen=True)
        if not full.startswith(head):
            raise ValueError("the chat template does not render an assistant turn as prompt + content; "
                             "cannot build observation turns from it")
        return full[len(head):]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, gen=True))

    def reply_ids(self, reply: str) -> list[int]:
        """A reply written as text (an expert's), as ids the policy would sample: tokenised in place after
        the generation prompt, as the full template tokenises it (SentencePiece tokenisers encode a
        text's first word differently at the start of a string), then the end-of-turn token."""
        head = self._render([{"role": "user", "content": "U"}], gen=True)
        h, full = self.encode(head), self.encode(head + reply)
        ids = full[len(h):] if full[:len(h)] == h else self.encode(reply)
        return ids + [self.eot_id]

    def observation_ids(self, observation: str, reply_ended: bool) -> list[int]:
        """Ids to append after a reply: the end-of-turn token (unless the policy sampled it), the user
        turn with `observation`, and the generation prompt. Tokenised with the end-of-turn special token
        in front, as inside the full template, so boundaries match."""
        ids = self.encode(self._after_reply(observation))
        if reply_ended and self.eot_is_anchor:
            ids = ids[1:]
        return ids

    def _check_prefix_preserving(self) -> bool:
        """Does rendering a longer conversation keep the shorter one as its prefix, reasoning included?"""
        msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"}]
        short = self._render(msgs, gen=False)
        eos = self.tok.eos_token or ""
        if eos and short.endswith(eos):  # Phi-3 ends a finished conversation with eos
            short = short[: -len(eos)]
        return self._render(msgs + [{"role": "user", "content": "Q2"}], gen=True).startswith(short)


# ---------------------------------------------------------------- trajectories
@dataclass
class Trajectory:
    env: str
    item_id: int
    group: int
    messages: list[dict]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: int = 0
    status: str = "running"
    reward: float = 0.0
    template: str = "exact"  # exact | noncanonical | mismatch (see the module docstring)
    error: str | None = None
    n_prompt: int = 0  # ids of the opening prompt
    agent: str = "react"  # the scheme that played it (agents.SCHEMES)

    @property
    def finished(self) -> bool:
        return self.status != "running"


def is_success(t: Trajectory) -> bool:
    """The one success rule: the env ended the episode (done) with a reward above 0."""
    return t.status == "done" and t.reward > 0


def check_against_template(fmt: ChatFormat, t: Trajectory) -> str:
    """exact: the row is the template's ids; noncanonical: same text, another valid tokenisation of
    sampled text; mismatch: the template renders these messages as other text."""
    text = fmt._render(t.messages, gen=True)
    if fmt.encode(text) == t.token_ids:
        return "exact"
    decoded = fmt.tok.decode(t.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return "noncanonical" if decoded == text else "mismatch"


@dataclass
class RolloutConfig:
    max_turns: int = 10  # assistant turns (the scheduler's horizon K)
    max_new_tokens: int = 64  # per turn
    max_context: int = 4096  # tokens per trajectory
    temperature: float = 1.0
    top_p: float = 1.0
    check_template: bool = True  # compare each row to the chat template every turn


# ---------------------------------------------------------------- who replies
@dataclass
class Reply:
    text: str
    ids: list[int] | None = None  # ids to append with loss mask 1; None: a text-only policy (no rows)
    logprobs: list[float] | None = None  # the sampler's log-prob of each id (0 for written text)
    stopped: bool = True  # ended with the end-of-turn token (False: cut at max_new_tokens)


class EnginePolicy:
    """Replies sampled by a generation engine (engines.HFEngine, engines.VLLMEngine) from each row."""

    def __init__(self, engine, fmt: ChatFormat, cfg: RolloutConfig, generator: torch.Generator | None = None):
        self.engine, self.fmt, self.cfg, self.generator = engine, fmt, cfg, generator

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply]:
        cfg = self.cfg
        samples = self.engine.generate([t.token_ids for t in trajs], cfg.max_new_tokens, self.fmt.stop_ids,
                                       cfg.temperature, cfg.top_p, self.generator, reuse=True)
        return [Reply(self.fmt.decode(s.ids[:-1] if s.stopped else s.ids), s.ids, s.logprobs, s.stopped)
                for s in samples]

    def finish(self) -> None:
        self.engine.forget()  # the conversations are over: free the cache kept for their next turn


# ---------------------------------------------------------------- the turn loop
def start_trajectories(pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
                       agents: list | None = None) -> list[Trajectory]:
    """Reset pool instance i to task item_ids[i] (fewer tasks than instances: the rest stay idle); one
    Trajectory each with its agent's opening messages (default: react), or status env_error when the
    reset failed."""
    assert len(item_ids) == len(groups) <= pool.size
    agents = agents or [make_agent("react", env, 0) for _ in item_ids]
    trajs = []
    firsts = pool.reset(list(item_ids) + [None] * (pool.size - len(item_ids)))
    for item, group, first, agent in zip(item_ids, groups, firsts, agents):
        t = Trajectory(env, item, group, [], [], [], [], agent=agent.name)
        if isinstance(first, EnvError):
            t.status, t.error = "env_error", str(first)
        else:
            t.messages = agent.opening(first)
        trajs.append(t)
    return trajs


def play_moves(pool: EnvPool, trajs: list[Trajectory], agents: list, moves: dict[int, Move], max_turns: int) -> None:
    """One turn's env side, for the trajectories that replied (moves[i] from agents[i].act): the actions
    go to the env in one batched call; then each trajectory gets its next user message (the agent's
    rendering of the env's answer, or its note where there was no step), its reward and status; where the
    agent retries, the env is reset to the same task and the reward starts again from 0. The reward is
    the step's value on the trainer's scale (train_reward)."""
    results = pool.step([moves[i].action if i in moves else None for i in range(pool.size)])
    retry = []
    for i, move in moves.items():
        t, agent, r = trajs[i], agents[i], results[i]
        if isinstance(r, EnvError):
            t.status, t.error = "env_error", str(r)
            continue
        if move.action is None:
            text, outcome = agent.observe(move.note, None, False, t.turns)
        else:
            t.reward = train_reward(t.env, r.reward)
            text, outcome = agent.observe(r.observation, t.reward, r.done, t.turns)
        t.messages.append({"role": "user", "content": text})
        if outcome == "done":
            t.status = "done"
        elif outcome == "retry":
            retry.append(i)
        elif t.turns >= max_turns:
            t.status = "max_turns"
    if retry:
        firsts = pool.reset([trajs[i].item_id if i in retry else None for i in range(pool.size)])
        for i in retry:
            if isinstance(firsts[i], EnvError):
                trajs[i].status, trajs[i].error = "env_error", str(firsts[i])
            else:
                agents[i].restart(firsts[i])
                trajs[i].reward = 0.0


def rollout(policy, pool: EnvPool, env: str, item_ids: list[int], groups: list[int], cfg: RolloutConfig,
            fmt: ChatFormat | None = None, agent: str = "react", progress=None) -> list[Trajectory]:
    """Play `item_ids[i]` in pool instance i, all at once, until every trajectory has ended; `agent`
    names the scheme (agents.SCHEMES). With `fmt`, every trajectory gets its token row; without, only
    its messages (a text policy such as a chat endpoint). `policy.replies` may answer an EnvError (the
    trajectory is an env error) or None (the policy has nothing to say: the trajectory ends, max_turns)."""
    agents = [make_agent(agent, env, cfg.max_turns) for _ in item_ids]
    trajs = start_trajectories(pool, env, item_ids, groups, agents)
    for t in trajs:
        if fmt is not None and not t.finished:
            t.token_ids = fmt.prompt_ids(t.messages)
            t.n_prompt = len(t.token_ids)
            t.loss_mask, t.logprobs = [0] * t.n_prompt, [0.0] * t.n_prompt
    for turn in range(cfg.max_turns):
        for t in trajs:  # the next reply must fit: stop before generating, not in the middle
            if fmt is not None and not t.finished and len(t.token_ids) + cfg.max_new_tokens > cfg.max_context:
                t.status = "context_limit"
        active = [i for i, t in enumerate(trajs) if not t.finished]
        if not active:
            break
        replies = dict(zip(active, policy.replies([trajs[i] for i in active], active)))
        moves = {i: agents[i].act(r.text) for i, r in replies.items() if _take_reply(trajs[i], r)}
        play_moves(pool, trajs, agents, moves, cfg.max_turns)
        for i in moves:
            if fmt is not None and not trajs[i].finished:
                _append_observation(fmt, trajs[i], replies[i].stopped, cfg)
        if progress is not None:
            progress(turn + 1, sum(t.finished for t in trajs), len(trajs))
    if hasattr(policy, "finish"):
        policy.finish()
    for t in trajs:
        if not t.finished:
            t.status = "max_turns"
    _warn_mismatch(fmt, trajs)
    return trajs


def _take_reply(t: Trajectory, r: Reply | EnvError | None) -> bool:
    """Add a reply to its trajectory; False where there is no move to play (an error, or no reply)."""
    if r is None or isinstance(r, EnvError):
        t.status, t.error = ("max_turns", None) if r is None else ("env_error", str(r))
        return False
    if r.ids is not None:
        t.token_ids += r.ids
        t.loss_mask += [1] * len(r.ids)
        t.logprobs += r.logprobs if r.logprobs is not None else [0.0] * len(r.ids)
    t.turns += 1
    t.messages.append({"role": "assistant", "content": r.text})
    return True


def _append_observation(fmt: ChatFormat, t: Trajectory, reply_ended: bool, cfg: RolloutConfig) -> None:
    """The observation turn's ids (loss mask 0) after a reply, then the checks of the grown row."""
    obs_ids = fmt.observation_ids(t.messages[-1]["content"], reply_ended)
    t.token_ids += obs_ids
    t.loss_mask += [0] * len(obs_ids)
    t.logprobs += [0.0] * len(obs_ids)
    if cfg.check_template and t.template != "mismatch":
        t.template = _worse(t.template, check_against_template(fmt, t))
    if len(t.token_ids) >= cfg.max_context:
        t.status = "context_limit"


def _warn_mismatch(fmt: ChatFormat | None, trajs: list[Trajectory]) -> None:
    mismatched = sum(t.template == "mismatch" for t in trajs)
    if mismatched:
        why = ("this template rewrites history (e.g. Qwen3 drops earlier <think> blocks)"
               if not fmt.prefix_preserving else "decode/encode is not a round trip for this tokenizer")
        warnings.warn(f"{mismatched}/{len(trajs)} rows differ from the chat template's rendering of their "
                      f"messages: {why}. Rows keep the ids the policy saw, and those are trained on.", stacklevel=3)


def _worse(a: str, b: str) -> str:
    order = ["exact", "noncanonical", "mismatch"]
    return order[max(order.index(a), order.index(b))]


def play_in_chunks(url: str, size: int, items: list[int], groups: list[int], play, desc: str = "play",
                   leave: bool = True, timeout: float = 120.0, played: list[Trajectory] = (),
                   chunk_done=None) -> list[Trajectory]:
    """Play episodes (task items[e], group groups[e]) on at most `size` env instances at once:
    play(pool, items, groups, progress) -> trajectories, chunk by chunk. The last chunk is padded to the
    pool's size with copies, which are dropped after. The progress bar counts ended episodes and shows
    the chunk and turn it is at; `play` hands `progress` on to rollout(). `played`: the trajectories of
    the first chunks, played before (a whole number of chunks); they are not played again.
    `chunk_done(c, trajectories)` is called after each chunk c."""
    from tqdm import tqdm

    size = max(1, min(size, len(items)))
    if len(played) % size and len(played) != len(items):
        raise ValueError(f"{len(played)} episodes played before are not whole chunks of {size}")
    trajs: list[Trajectory] = list(played)
    n_chunks = -(-len(items) // size)
    with EnvPool(url, size, timeout=timeout) as pool, \
            tqdm(total=len(items), initial=len(trajs), desc=desc, leave=leave, unit="ep", dynamic_ncols=True) as bar:
        for c, s in enumerate(range(0, len(items), size)):
            if s < len(trajs):
                continue
            its, gs = items[s:s + size], groups[s:s + size]

            def progress(turn: int, ended: int, n: int) -> None:  # called while this chunk plays
                bar.n = s + min(ended, len(its))  # the padding copies are not counted
                bar.set_postfix_str(f"chunk {c + 1}/{n_chunks}, turn {turn}", refresh=False)
                bar.refresh()

            got = play(pool, its + [its[-1]] * (size - len(its)), gs + [gs[-1]] * (size - len(gs)), progress)
            trajs += got[: len(its)]
            if chunk_done:
                chunk_done(c, got[: len(its)])
            bar.n = len(trajs)
            bar.refresh()
    return trajs


# ---------------------------------------------------------------- training batch
def build_batch(trajs: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the trainer; env errors are left out by the caller.

    input_ids, attention_mask, position_ids, loss_mask, old_logprobs: (B, T), aligned so that
    loss_mask[b, t] = 1 means token t was sampled by the policy with log-prob old_logprobs[b, t]
    given tokens < t. rewards: (B,) outcome rewards; the trainer puts each on the row's last sampled
    token (algos.token_rewards_from_outcome).
    """
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    lps = torch.zeros((B, T), dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    pos = torch.arange(T).expand(B, T).clone()
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group for t in trajs], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": mask,
            "old_logprobs": lps, "rewards": rewards, "group_ids": groups}


def length_buckets(lengths: list[int], max_tokens: int, overhead_tokens: int | None = None) -> list[list[int]]:
    """Split row indices into micro-batches of similar length, each with rows x longest <= max_tokens
    (a row longer than that gets its own batch), minimising padded tokens plus `overhead_tokens` per
    micro-batch (a forward pass has a fixed cost; default max_tokens / 16). Rows sorted by length make
    each batch a contiguous run, so a short dynamic programme finds the best cut points."""
    overhead = max_tokens // 16 if overhead_tokens is None else overhead_tokens
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    L = [lengths[i] for i in order]
    n = len(L)
    prefix = [0]
    for x in L:
        prefix.append(prefix[-1] + x)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of batching the j longest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # batch = sorted rows i..j-1; its longest is L[i]
            if L[i] * (j - i) > max_tokens and j - i > 1:
                break
            cost = best[i] + L[i] * (j - i) - (prefix[j] - prefix[i]) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


# ---------------------------------------------------------------- trajectory log
def write_log(path: str, step: int, max_turns: int, trajs: list[Trajectory]) -> None:
    """OUT/rollouts/step_000042.jsonl: one JSON object per trajectory, its fields and `step`, `max_turns`
    (the README's "Run folder" lists them); the viewer, sft.py --from-log and the tests read it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for t in trajs:
            d = asdict(t)
            d.update(step=step, max_turns=max_turns)
            f.write(json.dumps(d) + "\n")
    os.replace(tmp, path)


def informative_groups(trajs: list[Trajectory]) -> set[int]:
    """Groups whose trajectories (env errors left out) did not all score the same: the only ones whose
    GRPO/RLOO advantages are not all 0."""
    scores: dict = {}
    for t in trajs:
        if t.status != "env_error":
            scores.setdefault(t.group, set()).add(t.reward)
    return {g for g, s in scores.items() if len(s) > 1}


def rollout_metrics(trajs: list[Trajectory], K: int, time_rollout: float) -> dict:
    """Outcomes over the trajectories without env errors (infrastructure failures are not rewards);
    statuses and speed over all of them."""
    kept = [t for t in trajs if t.status != "env_error"]
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    groups = {t.group for t in kept}
    statuses = {s: sum(t.status == s for t in trajs) for s in ("done", "max_turns", "context_limit", "env_error")}
    n = max(1, len(kept))
    return {"max_turns": K, "reward_mean": sum(t.reward for t in kept) / n,
            "success_rate": sum(map(is_success, kept)) / n, "turns_mean": sum(t.turns for t in kept) / n,
            **{f"status_{k}": v for k, v in statuses.items()},
            "guess_share": sum(opens_by_guessing(t.messages) for t in kept) / n,
            "template_mismatch": sum(t.template == "mismatch" for t in trajs),
            "groups_informative": len(informative_groups(kept)) / max(1, len(groups)),
            "tokens_per_s": gen_tokens / max(time_rollout, 1e-9), "time_rollout_s": time_rollout}
