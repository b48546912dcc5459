"""Multi-turn rollouts, token in / token out (docs/algorithms.md: token row, statuses).

All unfinished trajectories reply together, then their envs step together (one batched call).
A trajectory's row of token ids is built by appending, never re-encoding: the prompt, then per
turn the sampled ids (loss mask 1, sampler log-probs kept) and the observation turn's ids
(mask 0), read off the tokenizer's own chat template (`ChatFormat`). So the ids trained on are
the ids the sampler produced and saw; each turn the row is checked against the template
(`Trajectory.template`).

Who replies is a policy with one method, `replies(trajectories, slots) -> [Reply]`: sampled
ids (`EnginePolicy`), or written text (eval.py's chat endpoint, the warm starts' expert). One
loop plays them all, so prompts, parsing, statuses and rows are the same for training,
evaluation and demonstrations. An env error is never a reward: the trajectory is dropped from
the loss.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import torch

from env_server.agents import Move, make_agent, random_moves, react_reply
from env_client import EnvError, EnvPool


# ------------------------------------------------------------ chat template, as token deltas
class ChatFormat:
    """What to append after a sampled reply, read off the tokenizer's own chat template:
    rendered on [user U, assistant A, user OBS], the text after "A" is the observation turn
    (end-of-turn marker, user turn, generation prompt); its first token is the end-of-turn
    token a reply ends with."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("no chat template in the tokenizer: use a chat/instruct model's")
        self.tok = tokenizer
        self._dialog = [{"role": "user", "content": "U"},
                        {"role": "assistant", "content": "A"}]
        self._gen_prompt = self._render(self._dialog[:1], gen=True)  # what a reply follows
        self._head = self._gen_prompt + "A"  # the dialog up to the end of the reply
        seen = self._render(self._dialog + [{"role": "user", "content": "x"}], gen=True)
        if not seen.startswith(self._head):  # Llama-2's puts a space before the reply
            raise ValueError("the chat template does not render an assistant turn as "
                             f"prompt + content (reply 'A' to 'U': {seen!r}); cannot build "
                             "observation turns from it")
        anchor = self.observation_ids("x", reply_ended=False)
        first = anchor[0] if anchor else None
        special = (set(tokenizer.all_special_ids)
                   | set(getattr(tokenizer, "added_tokens_decoder", {}) or {}))
        # The first token after the reply if it is special (<|im_end|>, <|end|>); else the eos
        self.eot_id = first if first in special else tokenizer.eos_token_id
        ends = (self.eot_id, tokenizer.eos_token_id)
        self.stop_ids = sorted({i for i in ends if i is not None})
        self.eot_is_anchor = first in special
        self.prefix_preserving = self._check_prefix_preserving()

    def _render(self, msgs: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Sampled ids as the text the env and the logs see, special tokens as written."""
        return self.tok.decode(ids, skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, gen=True))

    def reply_ids(self, reply: str) -> list[int]:
        """Written text (an expert's) as the ids the policy would sample, then the end-of-turn
        token: tokenised after the generation prompt, as in the full template (SentencePiece
        encodes a string's first word differently)."""
        h, full = self.encode(self._gen_prompt), self.encode(self._gen_prompt + reply)
        ids = full[len(h):] if full[:len(h)] == h else self.encode(reply)
        return ids + [self.eot_id]

    def observation_ids(self, observation: str, reply_ended: bool) -> list[int]:
        """Ids to append after a reply: the end-of-turn token (unless the policy sampled it),
        the user turn, the generation prompt; tokenised with the end-of-turn token in front,
        as inside the full template, so boundaries match."""
        turn = {"role": "user", "content": observation}
        ids = self.encode(self._render(self._dialog + [turn], gen=True)[len(self._head):])
        if reply_ended and self.eot_is_anchor:
            ids = ids[1:]
        return ids

    def _check_prefix_preserving(self) -> bool:
        """Does rendering a longer conversation keep the shorter one as its prefix, reasoning
        included?"""
        msgs = [{"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"}]
        short = self._render(msgs, gen=False)
        eos = self.tok.eos_token or ""
        if eos and short.endswith(eos):  # Phi-3 ends a finished conversation with eos
            short = short[: -len(eos)]
        longer = self._render(msgs + [{"role": "user", "content": "Q2"}], gen=True)
        return longer.startswith(short)


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
    template: str = "exact"  # one of TEMPLATE_CHECKS
    error: str | None = None
    n_prompt: int = 0  # ids of the opening prompt
    agent: str = "react"  # the scheme that played it (agents.SCHEMES)
    # each turn's change of `reward`, a retry's reset included (GiGPO's steps): they sum to it
    turn_rewards: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status != "running"

    def append_ids(self, ids: list[int], sampled: bool = False,
                   logprobs: list[float] | None = None) -> None:
        """Grow the row: if sampled, loss mask 1 and the sampler's log-probs; else 0s."""
        self.token_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def is_success(t: Trajectory) -> bool:
    """The one success rule: the env ended the episode (done) with a reward above 0."""
    return t.status == "done" and t.reward > 0


def informative_groups(trajs: list[Trajectory]) -> set[int]:
    """Groups not all of one score (env errors aside): the only ones with GRPO/RLOO signal."""
    scores: dict = {}
    for t in trajs:
        if t.status != "env_error":
            scores.setdefault(t.group, set()).add(t.reward)
    return {g for g, s in scores.items() if len(s) > 1}


def turn_state_keys(t: Trajectory, reported: list[str] | None = None) -> list[str]:
    """GiGPO's anchor state of each sampled turn (algos.anchor_index): the user message before
    it, or `reported`, a key per turn from the env (none reports one yet). The sampled turns
    are the last `t.turns` assistant messages: the opening may hold an unsampled ack."""
    if reported is not None:
        if len(reported) != t.turns:
            raise ValueError(f"{len(reported)} reported state keys for {t.turns} turns")
        return list(reported)
    replies = [i for i, m in enumerate(t.messages) if m["role"] == "assistant"]
    replies = replies[len(replies) - t.turns:]
    assert all(i > 0 and t.messages[i - 1]["role"] == "user" for i in replies), \
        "every sampled turn follows a user message"
    return [t.messages[i - 1]["content"] for i in replies]


# The row against the template's rendering of its messages, from best to worst: the same ids;
# the same text, another valid tokenisation of sampled text; other text (a template that
# rewrites history, e.g. Qwen3 drops old <think> blocks). The row keeps what the policy saw.
TEMPLATE_CHECKS = ("exact", "noncanonical", "mismatch")


def check_against_template(fmt: ChatFormat, t: Trajectory) -> str:
    """t's row as a prefix of its messages' rendering (a row ends in a reply, the last turn's, or
    in an observation, cut at --max-context or whole); the worst check so far stays."""
    text = fmt._render(t.messages, gen=t.messages[-1]["role"] == "user")
    if fmt.encode(text)[:len(t.token_ids)] == t.token_ids:
        return t.template
    return "noncanonical" if text.startswith(fmt.decode(t.token_ids)) else "mismatch"


@dataclass
class RolloutConfig:
    max_turns: int = 10  # assistant turns (the scheduler's horizon K)
    max_new_tokens: int = 64  # per turn
    max_context: int = 4096  # tokens per trajectory
    temperature: float = 1.0
    top_p: float = 1.0
    check_template: bool = True  # compare each row to the chat template every turn

    @classmethod
    def of(cls, cfg, max_turns: int) -> "RolloutConfig":
        """The one place a script's flags become rollout settings (train, eval, sft)."""
        return cls(max_turns=max_turns, max_new_tokens=cfg.max_new_tokens,
                   max_context=getattr(cfg, "max_context", 4096),
                   temperature=cfg.temperature, top_p=getattr(cfg, "top_p", 1.0))


# ---------------------------------------------------------------- who replies
@dataclass
class Reply:
    text: str
    ids: list[int] | None = None  # ids appended with loss mask 1; None: a text-only policy
    logprobs: list[float] | None = None  # the sampler's log-prob of each id (written text: 0)
    stopped: bool = True  # ended with the end-of-turn token (False: cut at max_new_tokens)


class EnginePolicy:
    """Replies sampled from each row by a generation engine (engines.py's interface)."""

    def __init__(self, engine, fmt: ChatFormat, cfg: RolloutConfig,
                 generator: torch.Generator | None = None):
        self.engine, self.fmt, self.cfg, self.generator = engine, fmt, cfg, generator

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply]:
        cfg = self.cfg
        samples = self.engine.generate([t.token_ids for t in trajs], cfg.max_new_tokens,
                                       self.fmt.stop_ids, cfg.temperature, cfg.top_p,
                                       self.generator, reuse=True)
        return [Reply(self.fmt.decode(s.ids[:-1] if s.stopped else s.ids), s.ids, s.logprobs,
                      s.stopped and s.ids[-1] == self.fmt.eot_id)  # stopped by eos: eot added
                for s in samples]

    def finish(self) -> None:
        self.engine.forget()  # conversations over: free the cache kept for their next turn


class RandomPolicy:
    """Chance: each reply is a move drawn uniformly from the game's (agents.random_moves), in
    the game's reply format (agents.react_reply). With `fmt` the reply has the ids a model
    would sample (log-probs 0: nothing was sampled), as a demonstration; without, it is text
    only, as an endpoint's."""

    name = "random"

    def __init__(self, env: str, seed: int = 0, fmt: ChatFormat | None = None):
        self.env, self.fmt, self.rng = env, fmt, random.Random(seed)

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply]:
        out = []
        for t in trajs:
            text = react_reply(self.env, self.rng.choice(random_moves(self.env, t.messages)))
            ids = None if self.fmt is None else self.fmt.reply_ids(text)
            out.append(Reply(text, ids, None if ids is None else [0.0] * len(ids)))
        return out


# ---------------------------------------------------------------- the turn loop
def start_trajectories(pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
                       agents: list, cfg: RolloutConfig) -> list[Trajectory]:
    """Reset pool instance i to task item_ids[i] (the others stay idle): a Trajectory each,
    with its agent's opening messages, or env_error where the reset failed."""
    assert len(item_ids) == len(groups) <= pool.size
    trajs = []
    firsts = pool.reset(list(item_ids) + [None] * (pool.size - len(item_ids)))
    for item, group, first, agent in zip(item_ids, groups, firsts, agents):
        t = Trajectory(env, item, group, [], [], [], [], agent=agent.name)
        if isinstance(first, EnvError):
            t.status, t.error = "env_error", str(first)
        else:
            t.messages = agent.opening(_fit(first, t, cfg))
        trajs.append(t)
    return trajs


# The reward's scale: what a game's step value (Step.reward) is divided by, so that success is 1
# in every game: SciWorld scores 0-100 (negative after a fatal mistake), as AgentGym's server
# does; the rest 0-1.
SCORE_SCALES = {"sciworld": 100.0}


def train_reward(env: str, value: float) -> float:  # applied to every step's value, below
    return value / SCORE_SCALES.get(env, 1.0)


def play_moves(pool: EnvPool, trajs: list[Trajectory], agents: list, moves: dict[int, Move],
               cfg: RolloutConfig) -> None:
    """A turn's env side, for the trajectories with a move (agents[i].act(reply)): one batched
    step; then each gets its next user message (the agent's rendering of the answer, or its
    note where nothing was stepped), its reward on the trainer's 0-1 scale and its status."""
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
            seen = _fit(r.observation, t, cfg)
            text, outcome = agent.observe(seen, t.reward, r.done, t.turns)
        t.messages.append({"role": "user", "content": text})
        if outcome == "done":
            t.status = "done"
        elif outcome == "retry":
            retry.append(i)
        elif t.turns >= cfg.max_turns:
            t.status = "max_turns"
    if retry:
        _retry(pool, trajs, agents, retry, cfg)
    for i in moves:  # after the resets: a retried attempt's reward is undone on its last turn
        t = trajs[i]
        if t.status != "env_error":
            t.turn_rewards.append(t.reward - sum(t.turn_rewards))


def _retry(pool: EnvPool, trajs: list[Trajectory], agents: list, retry: list[int],
           cfg: RolloutConfig) -> None:
    """An agent's retry (agents.Reflect): its env reset to the same task, its reward to 0."""
    firsts = pool.reset([trajs[i].item_id if i in retry else None for i in range(pool.size)])
    for i in retry:
        if isinstance(firsts[i], EnvError):
            trajs[i].status, trajs[i].error = "env_error", str(firsts[i])
        else:
            agents[i].restart(_fit(firsts[i], trajs[i], cfg))
            trajs[i].reward = 0.0


def rollout(policy, pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
            cfg: RolloutConfig, fmt: ChatFormat | None = None, agent: str = "react",
            progress=None) -> list[Trajectory]:
    """Play `item_ids[i]` in pool instance i, all at once, until every trajectory has ended.
    Without `fmt` (a text policy) no token rows. A reply may be an EnvError (the trajectory is
    an env error) or None (the policy has nothing to say: max_turns)."""
    agents = [make_agent(agent, env, cfg.max_turns) for _ in item_ids]
    trajs = start_trajectories(pool, env, item_ids, groups, agents, cfg)
    for t in trajs:
        if fmt is not None and not t.finished:
            t.append_ids(fmt.prompt_ids(t.messages))
            t.n_prompt = len(t.token_ids)
    for turn in range(cfg.max_turns):
        for t in trajs:  # the next reply must fit: stop before generating, not in the middle
            if (fmt is not None and not t.finished
                    and len(t.token_ids) + cfg.max_new_tokens > cfg.max_context):
                t.status = "context_limit"
        active = [i for i, t in enumerate(trajs) if not t.finished]
        if not active:
            break
        replies = dict(zip(active, policy.replies([trajs[i] for i in active], active)))
        moves = {i: agents[i].act(r.text) for i, r in replies.items()
                 if _take_reply(trajs[i], r)}
        play_moves(pool, trajs, agents, moves, cfg)
        for i in moves:
            if fmt is not None and not trajs[i].finished:
                _append_observation(fmt, trajs[i], replies[i].stopped, cfg)
            if fmt is not None and cfg.check_template and trajs[i].template != "mismatch":
                trajs[i].template = check_against_template(fmt, trajs[i])
        if progress is not None:
            progress(turn + 1, sum(t.finished for t in trajs), len(trajs))
    if hasattr(policy, "finish"):
        policy.finish()
    for t in trajs:
        if not t.finished:
            t.status = "max_turns"
    if any(t.template == "mismatch" for t in trajs):  # a warning, off the usual path
        _warn_mismatch(fmt, trajs)
    return trajs


def _take_reply(t: Trajectory, r: Reply | EnvError | None) -> bool:
    """Add a reply to its trajectory; False where there is no move (an error, no reply)."""
    if r is None or isinstance(r, EnvError):
        t.status, t.error = ("max_turns", None) if r is None else ("env_error", str(r))
        return False
    if r.ids is not None:
        t.append_ids(r.ids, sampled=True, logprobs=r.logprobs)
    t.turns += 1
    t.messages.append({"role": "assistant", "content": r.text})
    return True


# No tokenizer's tokens run longer, in practice: text past this many characters a token of
# room cannot fit, and is cut before it is tokenized whole, logged or sent to an endpoint
CHARS_PER_TOKEN = 32


def _fit(text: str, t: Trajectory, cfg: RolloutConfig) -> str:
    """An env's observation cut to what could still fit in t's --max-context, before its agent
    adds its own words (a reflection's request stays): a server that answers 10 MB would
    otherwise cost seconds and gigabytes to tokenize, and as much in the log."""
    budget = max(cfg.max_context - len(t.token_ids), 0) * CHARS_PER_TOKEN
    if len(text) <= budget:
        return text
    return f"{text[:budget]} [... {len(text) - budget} characters cut]"


def _append_observation(fmt: ChatFormat, t: Trajectory, reply_ended: bool,
                        cfg: RolloutConfig) -> None:
    """The observation turn's ids (loss mask 0) after a reply. A row they fill ends at
    --max-context: nothing after its last reply is trained on."""
    ids = fmt.observation_ids(t.messages[-1]["content"], reply_ended)
    room = max(cfg.max_context - len(t.token_ids), 0)
    t.append_ids(ids[:room])
    if len(t.token_ids) >= cfg.max_context:
        t.status = "context_limit"


def _warn_mismatch(fmt: ChatFormat, trajs: list[Trajectory]) -> None:
    mismatched = sum(t.template == "mismatch" for t in trajs)
    why = ("this template rewrites history (e.g. Qwen3 drops earlier <think> blocks)"
           if not fmt.prefix_preserving else "decode/encode is not a round trip for this tokenizer")
    warnings.warn(f"{mismatched}/{len(trajs)} rows differ from the chat template's rendering of "
                  f"their messages: {why}. Rows keep the ids the policy saw, and those are "
                  "trained on.", stacklevel=3)


def play_in_chunks(url: str, size: int, items: list[int], groups: list[int], play,
                   desc: str = "play", leave: bool = True, timeout: float = 120.0,
                   played: list[Trajectory] = (), chunk_done=None) -> list[Trajectory]:
    """Episodes (task items[e], group groups[e]) on at most `size` instances at once, chunk by
    chunk: play(pool, items, groups, progress) -> trajectories, the last chunk padded with
    copies (dropped after). `played`: whole chunks played before (a resumed evaluation), not
    played again; `chunk_done(c, trajectories)` after each chunk c. A progress bar counts
    ended episodes."""
    from tqdm import tqdm

    size = max(1, min(size, len(items)))
    if len(played) % size and len(played) != len(items):
        raise ValueError(f"{len(played)} episodes played before are not whole chunks of "
                         f"{size}")
    trajs: list[Trajectory] = list(played)
    n_chunks = -(-len(items) // size)
    with EnvPool(url, size, timeout=timeout) as pool, \
            tqdm(total=len(items), initial=len(trajs), desc=desc, leave=leave, unit="ep",
                 dynamic_ncols=True) as bar:
        for c, s in enumerate(range(0, len(items), size)):
            if s < len(trajs):
                continue
            its, gs = items[s:s + size], groups[s:s + size]

            # called while this chunk plays
            def progress(turn: int, ended: int, n: int) -> None:
                bar.n = s + min(ended, len(its))  # the padding copies are not counted
                bar.set_postfix_str(f"chunk {c + 1}/{n_chunks}, turn {turn}", refresh=False)
                bar.refresh()

            pad = size - len(its)  # len(gs) == len(its)
            got = play(pool, its + [its[-1]] * pad, gs + [gs[-1]] * pad, progress)
            trajs += got[: len(its)]
            if chunk_done:
                chunk_done(c, got[: len(its)])
            bar.n = len(trajs)
            bar.refresh()
    return trajs
