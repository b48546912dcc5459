"""The agent side of an environment: its instructions, how a reply becomes an action, and what the
agent does between attempts. Two registries, plain dicts filled by one call each:

    register_env(name, server=..., instructions=..., parse_action=...)   # ENVS: one entry per game
    register_scheme(cls)                                                  # SCHEMES: react, plan,
                                                                            reflect

An env's entry names its server class ("module:Class" under env_server/, imported only when used, or
None for a game served by another project, such as WebArena), the instruction turn that opens every
episode, and the parser that turns a reply into the action string the server steps with. `env_spec`
checks an entry at start-up and names everything that is missing in one message.

One agent object plays one trajectory (`React` or a subclass); the rollout asks it, turn by turn:

    messages = agent.opening(first_observation)          # the instruction turns
    move = agent.act(reply)                               # an action for the env, or a note
                                                            without a step
    text, outcome = agent.observe(text, reward, done, turns)   # the next user message; "done",
                                                                 "retry", None
    agent.restart(first_observation)                      # after "retry": the env was reset to
                                                            the same task

Schemes (`--agent` in train.py and eval.py):
- react: Thought / Action, one action per reply (the seed framework's format; the default).
- plan: the first reply is a plan for the whole task, without an action; it stays in context and the
  later replies act on it.
- reflect: Reflexion-style. An attempt that fails (the env ends it without reward, or it uses its
  share of the turns) is followed by a reflection turn: the env is reset to the same task and the
  agent, having written what went wrong, tries again in the same trajectory. The reward is the last
  attempt's.

Every reply is sampled text and is trained on (loss mask 1), plans and reflections included; the
notes the agent sends back instead of an env observation are user turns (mask 0).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from typing import Callable


# ---------------------------------------------------------------- action parsing
@dataclass
class ParsedAction:
    action: str | None  # what to send to the env; None: do not step, reply with `error` instead
    error: str | None = None  # the observation the agent gets instead of stepping the env


ONE_ACTION_ERROR = "Error: Only one 'Action' is allowed per response. Please adjust your response."
_ACTION_RE = re.compile(r"Action:\s*(.*?)(?=\n|$)", re.DOTALL)
_NOT_ACTION_CHARS = re.compile(r"[^A-Za-z0-9, ]+")
_BACKTICK_BLOCK_RE = re.compile(r"```(.*?)```", re.DOTALL)
# The observation AgentGym's WebArena client gives for a reply without an action block (kept
# verbatim: agents trained on its transcripts have seen exactly this text).
WEBARENA_NO_ACTION = ("Cannot parse action from response. Your action should be inside triple "
                      "backticks (```). Please adjust accordingly.")


def parse_thought_action(reply: str) -> ParsedAction:
    """TextCraft and BabyAI ("Thought: ... Action: ..."): the line after `Action:`; more than one
    `Action:` is refused with an error observation (reward 0, episode goes on); characters outside
    [A-Za-z0-9, ] are removed and whitespace collapsed. No `Action:` at all sends an empty
    action."""
    found = _ACTION_RE.findall(reply)
    if len(found) > 1:
        return ParsedAction(None, ONE_ACTION_ERROR)
    action = found[0] if found else ""
    return ParsedAction(" ".join(_NOT_ACTION_CHARS.sub("", action).split()))


def parse_last_action(reply: str) -> ParsedAction:
    """SciWorld: the text after the last `Action:` (the whole reply when there is none)."""
    return ParsedAction(reply.rsplit("Action:", 1)[-1].strip())


def parse_search_answer(reply: str) -> ParsedAction:
    """Deep Search: the first `<search>..</search>` or `<answer>..</answer>` block, sent as
    written (the block that opens first, closed by the first closing tag of its own kind).

    Scanned with str.find, not a regex: a lazy `<(search|answer)>(.*?)</\1>` retries from every
    unclosed opening tag, quadratic in the reply (a 100 KB reply of `<search>` took ~16 s). Only
    a tag's first opening can matter: if it has no closing tag after it, no later one has."""
    best = None  # (start, end) of the earliest closed block
    for tag in ("search", "answer"):
        start = reply.find(f"<{tag}>")
        if start < 0 or (best is not None and start > best[0]):
            continue
        close = reply.find(f"</{tag}>", start + len(tag) + 2)
        if close >= 0:
            best = (start, close + len(tag) + 3)
    return ParsedAction(reply[best[0]:best[1]] if best else "")


def parse_whole_reply(reply: str) -> ParsedAction:
    """The game reads the words itself (Corridor: the last "left" or "right" counts)."""
    return ParsedAction(reply)


def parse_webarena(reply: str) -> ParsedAction:
    """WebArena: the server parses the first ```action``` block itself, so the whole reply goes; a
    reply without a block is answered here, as AgentGym's client does, without stepping the
    browser."""
    if not _BACKTICK_BLOCK_RE.search(reply):
        return ParsedAction(None, WEBARENA_NO_ACTION)
    return ParsedAction(reply)


# ---------------------------------------------------------------- the env registry
@dataclass(frozen=True)
class EnvSpec:
    name: str
    # "module:Class" (or the class) of this project's server; None: served elsewhere
    server: str | type | None
    instructions: str | None  # the instruction turn that opens every episode
    parse_action: Callable[[str], ParsedAction] | None  # reply -> action
    # messages so far -> the moves a random policy draws from (chance); None: no such policy
    random_moves: Callable[[list[dict]], list[str]] | None = None


ENVS: dict[str, EnvSpec] = {}


def register_env(name: str, *, server: str | type | None, instructions: str | None,
                 parse_action: Callable[[str], ParsedAction] | None,
                 random_moves: Callable[[list[dict]], list[str]] | None = None) -> EnvSpec:
    """Add (or replace) the game `name`. Nothing is imported here; `env_spec` checks the entry when
    a script starts, so a game registered with a part missing fails then, with one message.
    `random_moves` defines chance for the game (rollout.RandomPolicy draws from it)."""
    ENVS[name] = EnvSpec(name, server, instructions, parse_action, random_moves)
    return ENVS[name]


def env_spec(name: str) -> EnvSpec:
    """The registered game `name`, checked whole: its server class (importable, an
    `env_server.base.Env` with num_tasks, reset and step of its own), its instructions and its
    action parser. Raises ValueError with one message naming every missing part."""
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(ENVS))} "
                         "(agents.register_env adds one)")
    spec = ENVS[name]
    missing = []
    if not isinstance(spec.instructions, str) or not spec.instructions.strip():
        missing.append("instructions (the text of the opening user turn)")
    if not callable(spec.parse_action):
        missing.append("parse_action (a function reply -> ParsedAction)")
    if spec.server is not None:
        try:
            server_class(spec)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            missing.append(f"a usable server class ({e})")
    if missing:
        raise ValueError(f"environment {name!r} is registered without " + "; ".join(missing) +
                         ". Complete its agents.register_env(...) call (tests/toy_env.py shows a "
                         "whole one).")
    return spec


def server_class(spec: EnvSpec) -> type:
    """The Env subclass that serves `spec`, imported on first use (BabyAI pulls in minigrid,
    SciWorld a JVM)."""
    from env_server.base import Env

    cls = spec.server
    if isinstance(cls, str):
        module, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"{spec.server!r} is not a subclass of env_server.base.Env")
    lacking = [m for m in ("num_tasks", "reset", "step") if getattr(cls, m) is getattr(Env, m)]
    if lacking:
        raise TypeError(f"{cls.__name__} does not define {', '.join(lacking)}")
    return cls


def served_here(name: str) -> bool:
    """Whether this project serves `name` (else a server elsewhere does, reached with
    --env-addr)."""
    return name in ENVS and ENVS[name].server is not None


def _part(env: str, field: str):
    """One part of a registered game, without the whole check (env_spec) on every episode; a part
    that is missing raises env_spec's message."""
    value = getattr(ENVS.get(env), field, None)
    return value if value else getattr(env_spec(env), field)


def parse_action(env: str, reply: str) -> ParsedAction:
    return _part(env, "parse_action")(reply)


def system_prompt(env: str) -> str:
    return _part(env, "instructions")


def has_chance(env: str) -> bool:
    """Whether the game defines a random policy (register_env's random_moves)."""
    return getattr(ENVS.get(env), "random_moves", None) is not None


def random_moves(env: str, messages: list[dict]) -> list[str]:
    """The moves a random policy of `env` draws from, given the conversation so far (ValueError
    naming the games that have one, where `env` has none)."""
    moves = getattr(ENVS.get(env), "random_moves", None)
    if moves is None:
        have = sorted(n for n, s in ENVS.items() if s.random_moves is not None)
        raise ValueError(f"{env!r} defines no random policy (chance); games that do: "
                         f"{', '.join(have)}")
    return moves(messages)


# ---------------------------------------------------------------- chance, per game
# A random policy draws each turn's action uniformly from these. Corridor and BabyAI list their
# available actions; TextCraft's actions are free text, so "random" there means uniform over the
# commands its first observation makes concrete: each listed crafting command, `get` of each
# ingredient those commands name in the number they name (only base items can be got), and
# `inventory`.
def _corridor_moves(messages: list[dict]) -> list[str]:
    return ["left", "right"]


def _doors_moves(messages: list[dict]) -> list[str]:
    return ["left", "right", "open"]


_LISTED_ACTIONS = re.compile(r"Available actions: (\[.*\])")


def _babyai_moves(messages: list[dict]) -> list[str]:
    found = _LISTED_ACTIONS.findall(messages[-1]["content"])
    return json.loads(found[-1]) if found else ["check available actions"]


def _textcraft_moves(messages: list[dict]) -> list[str]:
    first = next(m["content"] for m in messages if m["role"] == "user"
                 and "Crafting commands:" in m["content"])
    crafts = [ln.strip() for ln in first.splitlines() if ln.startswith("craft ")]
    gets = {f"get {part.strip()}" for c in crafts for part in c.split(" using ", 1)[1].split(",")}
    return crafts + sorted(gets) + ["inventory"]


# ---------------------------------------------------------------- the games
register_env("textcraft", server="env_server.textcraft:TextCraftEnv",
             parse_action=parse_thought_action, random_moves=_textcraft_moves, instructions=(
    "You are playing a crafting game. Each turn you get an observation and answer with one "
    "action.\n"
    "Commands:\n"
    "- get N item: take N of a base item, e.g. get 2 oak log\n"
    "- craft N item using N ingredient, N ingredient: use exactly one of the listed crafting "
    "commands, e.g. craft 4 oak planks using 1 oak log; a generic ingredient such as planks may be "
    "given as a specific kind such as dark oak planks\n"
    "- inventory: list what you hold\n"
    "Answer in this format:\nThought: <your reasoning>\nAction: <one command>"))
register_env("babyai", server="env_server.babyai:BabyAIEnv", parse_action=parse_thought_action,
             random_moves=_babyai_moves, instructions=(
    "You are an agent in a grid world with rooms, doors, keys, balls and boxes. Each turn you get "
    "an observation and answer with one action.\n"
    "Actions: turn left, turn right, move forward, go to <obj> <n>, pickup <obj> <n>, "
    "go through <door> <n>, toggle and go through <door> <n>, toggle, drop, check available "
    "actions.\n"
    "Answer in this format:\nThought: <your reasoning>\nAction: <one action>"))
register_env("sciworld", server="env_server.sciworld:SciWorldEnv", parse_action=parse_last_action,
             instructions=(
    "You are doing an elementary science task in a simulated world of rooms, objects, substances, "
    "plants and animals. Each turn you get an observation and answer with one action.\n"
    "Actions (OBJ is an object or a place): look around, look at OBJ, look in OBJ, read OBJ, go to "
    "OBJ, open OBJ, close OBJ, pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ into OBJ, dunk "
    "OBJ into OBJ, mix OBJ, activate OBJ, deactivate OBJ, use OBJ, use OBJ on OBJ, connect OBJ to "
    "OBJ, disconnect OBJ, eat OBJ, flush OBJ, focus on OBJ (marks the object the task is about: "
    "focusing on the wrong one fails the task), wait (ten time steps), wait1 (one), inventory, "
    "task (repeats the task).\n"
    "Answer in this format:\nThought: <your reasoning>\nAction: <one action>"))
register_env("searchqa", server="env_server.searchqa:SearchQAEnv", parse_action=parse_search_answer,
             instructions=(
    "You answer questions about facts you may not know, using a search engine. Each turn, reason "
    "inside <think>...</think>, then end with exactly one block: <search>query</search> to look "
    "something up (the results come back inside <information>...</information>), or "
    "<answer>short answer</answer> when you are sure. Only the first block of a reply is read."))
register_env("webarena", server=None, parse_action=parse_webarena, instructions=(
    "You are an agent operating a web browser to complete a task. Each turn you get the task's "
    "objective, the current page as an accessibility tree (every element has an [id]), its URL and "
    "your previous action; answer with one action.\n"
    "Actions: click [id], type [id] [text] [1 to press Enter after typing, 0 not to], hover [id], "
    "press [key combination], scroll [up or down], new_tab, tab_focus [tab index], close_tab, "
    "goto [url], go_back, go_forward, and stop [answer] when the task is done (the answer in the "
    "brackets; N/A when the task cannot be done).\n"
    "Think step by step, then end your reply with the single action inside triple backticks, e.g. "
    "In summary, the next action I will perform is ```click [1234]```"))
register_env("corridor", server="env_server.corridor:CorridorEnv", parse_action=parse_whole_reply,
             random_moves=_corridor_moves,
             instructions="You are in a corridor. Each turn answer left or right to walk toward "
                          "the goal.")
register_env("doors", server="env_server.doors:DoorsEnv", parse_action=parse_whole_reply,
             random_moves=_doors_moves,
             instructions="You are in a corridor with doors. Walk to the goal; open a closed "
                          "door beside you. Each turn answer one word:\nright\nleft\nopen")
# What `python -m env_server NAME` knows: the games registered above. One registered (or replaced)
# later, by a script, is that script's alone: train.py then serves it on a thread of its own
# (trainer/cli.py's `serving_env`).
BUILT_IN = dict(ENVS)


def registered_here(name: str) -> bool:
    """Whether the game `name` was registered (or replaced) in this process after this module, so
    that a `python -m env_server` process would not serve it as registered here."""
    return name in ENVS and ENVS[name] is not BUILT_IN.get(name)

ACK = "OK. I will follow these instructions."


def opening_messages(env: str, first_observation: str, instructions: str = "") -> list[dict]:
    """Instruction turn (the game's, or `instructions` where given), the assistant's
    acknowledgement, then the env's first observation (as upstream)."""
    return [{"role": "user", "content": instructions or _part(env, "instructions")},
            {"role": "assistant", "content": ACK},
            {"role": "user", "content": first_observation}]


# The thoughts of the built-in warm start's habits (warmstart.py's guesser: fresh wrong actions, or
# one stalling action); train.py logs the share of episodes that open with either.
GUESS_THOUGHT = "I am not sure; I will guess."
STALL_THOUGHT = "I am not sure; I will check the available actions."


def opens_by_guessing(messages: list[dict]) -> bool:
    """Whether the episode's first reply (after the 3 opening messages) thinks a habit's thought."""
    return len(messages) > 3 and any(t in messages[3]["content"]
                                     for t in (GUESS_THOUGHT, STALL_THOUGHT))


def react_reply(env: str, action: str, thought: str | None = None) -> str:
    """An assistant reply in the env's format (Thought/Action; Deep Search: <think> then the tag
    block; a game that reads the whole reply, such as Corridor: the action alone where no
    thought is given), e.g. for expert demonstrations and the random policy."""
    if thought is None and getattr(ENVS.get(env), "parse_action", None) is parse_whole_reply:
        return action
    if env == "searchqa":
        kind = "answer" if action.startswith("<answer>") else "search"
        return f"<think>{thought or 'I will ' + kind + '.'}</think>\n{action}"
    return f"Thought: {thought or 'I will ' + action + '.'}\nAction: {action}"


# ---------------------------------------------------------------- schemes
@dataclass
class Move:
    action: str | None  # what to send to the env; None: no step this turn
    note: str | None = None  # the next user message when there is no step


SCHEMES: dict[str, type] = {}


def register_scheme(cls: type) -> type:
    """Class decorator: make `cls` (a React subclass with a `name`) available as `--agent NAME`."""
    if not (isinstance(getattr(cls, "name", None), str) and issubclass(cls, React)):
        raise TypeError(f"{cls!r}: an agent scheme is a subclass of agents.React with a `name`")
    SCHEMES[cls.name] = cls
    return cls


class React:
    """Thought / Action: every reply is parsed for one action (the env's registered parser)."""

    name = "react"

    def __init__(self, env: str, max_turns: int):
        self.env, self.max_turns = env, max_turns
        self.parse, self.instructions = _part(env, "parse_action"), _part(env, "instructions")

    def opening(self, first_observation: str) -> list[dict]:
        return opening_messages(self.env, first_observation, self.instructions)

    def act(self, reply: str) -> Move:
        parsed = self.parse(reply)
        return Move(parsed.action, parsed.error)

    def observe(self, text: str, reward: float | None, done: bool,
                turns: int) -> tuple[str, str | None]:
        """The env's answer to the last move (reward None: there was no step) -> (the next user
        message, "done" | "retry" | None). `turns` counts the replies so far."""
        return text, "done" if done else None

    def restart(self, first_observation: str) -> None:
        raise RuntimeError(f"the {self.name} scheme never retries")


register_scheme(React)

PLAN_ASK = ("Before you act, write a short numbered plan for the whole task. No action in this "
            "reply.")
PLAN_GO = "Now carry out your plan, one action per reply, in the format given at the start."


@register_scheme
class Plan(React):
    """The first reply is a plan (no env step); the plan stays in context and later replies act."""

    name = "plan"

    def __init__(self, env: str, max_turns: int):
        super().__init__(env, max_turns)
        self.planned = False

    def opening(self, first_observation: str) -> list[dict]:
        return opening_messages(self.env, f"{first_observation}\n\n{PLAN_ASK}", self.instructions)

    def act(self, reply: str) -> Move:
        if not self.planned:
            self.planned = True
            return Move(None, PLAN_GO)
        return super().act(reply)


REFLECT_ASK = ("This attempt failed. In two or three sentences, say what went wrong and what you "
               "will do differently. No action in this reply; the task then starts again.")
RESTART = "The task starts again. Use what you learned."


@register_scheme
class Reflect(React):
    """Up to `attempts` attempts in one trajectory, each but the last limited to its share of the
    turns, with a reflection turn between them; the env is reset to the same task for each new
    attempt."""

    name = "reflect"

    def __init__(self, env: str, max_turns: int, attempts: int = 2):
        super().__init__(env, max_turns)
        self.attempts = attempts
        # reflections take turns too
        self.attempt_turns = max(1, (max_turns - (attempts - 1)) // attempts)
        self.attempt, self.used = 1, 0  # the attempt under way; its replies so far
        self.first: str | None = None  # the new attempt's first observation
        self.phase = "act"  # act | reflect (the next reply is a reflection) | reflected

    def act(self, reply: str) -> Move:
        if self.phase == "reflect":
            self.phase = "reflected"
            return Move(None, f"{RESTART}\n\n{self.first}")
        return super().act(reply)

    def observe(self, text: str, reward: float | None, done: bool,
                turns: int) -> tuple[str, str | None]:
        # the reflection's answer: the new attempt's first observation
        if self.phase == "reflected":
            self.phase = "act"
            return text, None
        self.used += 1
        if done and reward is not None and reward > 0:
            return text, "done"
        failed = done or self.used >= self.attempt_turns
        if failed and self.attempt < self.attempts and turns + 2 <= self.max_turns:
            return f"{text}\n\n{REFLECT_ASK}", "retry"
        return text, "done" if done else None

    def restart(self, first_observation: str) -> None:
        self.first, self.phase = first_observation, "reflect"
        self.attempt, self.used = self.attempt + 1, 0


def make_agent(scheme: str, env: str, max_turns: int) -> React:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown agent scheme {scheme!r}; choose from {sorted(SCHEMES)}")
    return SCHEMES[scheme](env, max_turns)
