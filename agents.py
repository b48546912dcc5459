"""The agent module: how the model is prompted, how a reply becomes an action, and what happens between
attempts. One agent object per trajectory (`React` or a subclass); the rollout (rollout.py, and
eval.py's loop over a chat endpoint) asks it, turn by turn:

    messages = agent.opening(first_observation)          # the instruction turns
    move = agent.act(reply)                               # an action for the env, or a note without a step
    text, outcome = agent.observe(text, reward, done, turns)   # the next user message; "done", "retry", None
    agent.restart(first_observation)                      # after "retry": the env was reset to the same task

Schemes (`--agent` in train.py and eval.py):
- react: Thought / Action, one action per reply (the seed framework's format; the default).
- plan: the first reply is a plan for the whole task, without an action; it stays in context and the
  later replies act on it.
- reflect: Reflexion-style. An attempt that fails (the env ends it without reward, or it uses its share
  of the turns) is followed by a reflection turn: the env is reset to the same task and the agent, having
  written what went wrong, tries again in the same trajectory. The reward is the last attempt's.

Every reply is sampled text and is trained on (loss mask 1), plans and reflections included; the
notes the agent sends back instead of an env observation are user turns (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from env_client import parse_action

# ---------------------------------------------------------------- prompts, per environment
INSTRUCTIONS = {
    "textcraft": (
        "You are playing a crafting game. Each turn you get an observation and answer with one action.\n"
        "Commands:\n"
        "- get N item: take N of a base item, e.g. get 2 oak log\n"
        "- craft N item using N ingredient, N ingredient: use exactly one of the listed crafting "
        "commands, e.g. craft 4 oak planks using 1 oak log; a generic ingredient such as planks may be "
        "given as a specific kind such as dark oak planks\n"
        "- inventory: list what you hold\n"
        "Answer in this format:\nThought: <your reasoning>\nAction: <one command>"
    ),
    "babyai": (
        "You are an agent in a grid world with rooms, doors, keys, balls and boxes. Each turn you get an "
        "observation and answer with one action.\n"
        "Actions: turn left, turn right, move forward, go to <obj> <n>, pickup <obj> <n>, "
        "go through <door> <n>, toggle and go through <door> <n>, toggle, drop, check available actions.\n"
        "Answer in this format:\nThought: <your reasoning>\nAction: <one action>"
    ),
    "sciworld": (
        "You are doing an elementary science task in a simulated world of rooms, objects, substances, "
        "plants and animals. Each turn you get an observation and answer with one action.\n"
        "Actions (OBJ is an object or a place): look around, look at OBJ, look in OBJ, read OBJ, go to OBJ, "
        "open OBJ, close OBJ, pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ into OBJ, dunk OBJ into "
        "OBJ, mix OBJ, activate OBJ, deactivate OBJ, use OBJ, use OBJ on OBJ, connect OBJ to OBJ, "
        "disconnect OBJ, eat OBJ, flush OBJ, focus on OBJ (marks the object the task is about: focusing on "
        "the wrong one fails the task), wait (ten time steps), wait1 (one), inventory, task (repeats the "
        "task).\n"
        "Answer in this format:\nThought: <your reasoning>\nAction: <one action>"
    ),
    "searchqa": (
        "You answer questions about facts you may not know, using a search engine. Each turn, reason "
        "inside <think>...</think>, then end with exactly one block: <search>query</search> to look "
        "something up (the results come back inside <information>...</information>), or "
        "<answer>short answer</answer> when you are sure. Only the first block of a reply is read."
    ),
    "webarena": (
        "You are an agent operating a web browser to complete a task. Each turn you get the task's "
        "objective, the current page as an accessibility tree (every element has an [id]), its URL and "
        "your previous action; answer with one action.\n"
        "Actions: click [id], type [id] [text] [1 to press Enter after typing, 0 not to], hover [id], "
        "press [key combination], scroll [up or down], new_tab, tab_focus [tab index], close_tab, "
        "goto [url], go_back, go_forward, and stop [answer] when the task is done (the answer in the "
        "brackets; N/A when the task cannot be done).\n"
        "Think step by step, then end your reply with the single action inside triple backticks, e.g. "
        "In summary, the next action I will perform is ```click [1234]```"
    ),
    "corridor": "You are in a corridor. Each turn answer left or right to walk toward the goal.",
}
ACK = "OK. I will follow these instructions."


def system_prompt(env: str) -> str:
    if env not in INSTRUCTIONS:
        raise ValueError(f"no instructions for env {env!r}; known: {sorted(INSTRUCTIONS)}")
    return INSTRUCTIONS[env]


def opening_messages(env: str, first_observation: str) -> list[dict]:
    """Instruction turn, the assistant's acknowledgement, then the env's first observation (as upstream)."""
    return [{"role": "user", "content": system_prompt(env)}, {"role": "assistant", "content": ACK},
            {"role": "user", "content": first_observation}]


# The thoughts of the built-in warm start's habits (sft.expert_trajectories' guesser: fresh wrong
# actions, or one stalling action), which RL has to unlearn; train.py logs the share of episodes that
# open with either.
GUESS_THOUGHT = "I am not sure; I will guess."
STALL_THOUGHT = "I am not sure; I will check the available actions."


def opens_by_guessing(messages: list[dict]) -> bool:
    """Whether the episode's first reply (after the 3 opening messages) thinks a habit's thought."""
    return len(messages) > 3 and any(t in messages[3]["content"] for t in (GUESS_THOUGHT, STALL_THOUGHT))


def react_reply(env: str, action: str, thought: str | None = None) -> str:
    """An assistant reply in the env's format (Thought/Action; Deep Search: <think> then the tag block),
    e.g. for expert demonstrations."""
    if env == "searchqa":
        kind = "answer" if action.startswith("<answer>") else "search"
        return f"<think>{thought or 'I will ' + kind + '.'}</think>\n{action}"
    return f"Thought: {thought or 'I will ' + action + '.'}\nAction: {action}"


# ---------------------------------------------------------------- schemes
@dataclass
class Move:
    action: str | None  # what to send to the env; None: no step this turn
    note: str | None = None  # the next user message when there is no step


class React:
    """Thought / Action: every reply is parsed for one action (env_client.ACTION_PARSERS)."""

    name = "react"

    def __init__(self, env: str, max_turns: int):
        self.env, self.max_turns = env, max_turns

    def opening(self, first_observation: str) -> list[dict]:
        return opening_messages(self.env, first_observation)

    def act(self, reply: str) -> Move:
        parsed = parse_action(self.env, reply)
        return Move(parsed.action, parsed.error)

    def observe(self, text: str, reward: float | None, done: bool, turns: int) -> tuple[str, str | None]:
        """The env's answer to the last move (reward None: there was no step) -> (the next user message,
        "done" | "retry" | None). `turns` counts the replies so far."""
        return text, "done" if done else None

    def restart(self, first_observation: str) -> None:
        raise RuntimeError(f"the {self.name} scheme never retries")


PLAN_ASK = "Before you act, write a short numbered plan for the whole task. No action in this reply."
PLAN_GO = "Now carry out your plan, one action per reply, in the format given at the start."


class Plan(React):
    """The first reply is a plan (no env step); the plan stays in context and later replies act."""

    name = "plan"

    def __init__(self, env: str, max_turns: int):
        super().__init__(env, max_turns)
        self.planned = False

    def opening(self, first_observation: str) -> list[dict]:
        return opening_messages(self.env, f"{first_observation}\n\n{PLAN_ASK}")

    def act(self, reply: str) -> Move:
        if not self.planned:
            self.planned = True
            return Move(None, PLAN_GO)
        return super().act(reply)


REFLECT_ASK = ("This attempt failed. In two or three sentences, say what went wrong and what you will do "
               "differently. No action in this reply; the task then starts again.")
RESTART = "The task starts again. Use what you learned."


class Reflect(React):
    """Up to `attempts` attempts in one trajectory, each but the last limited to its share of the turns,
    with a reflection turn between them; the env is reset to the same task for each new attempt."""

    name = "reflect"

    def __init__(self, env: str, max_turns: int, attempts: int = 2):
        super().__init__(env, max_turns)
        self.attempts = attempts
        self.attempt_turns = max(1, (max_turns - (attempts - 1)) // attempts)  # reflections take turns too
        self.attempt, self.used = 1, 0  # the attempt under way; its replies so far
        self.first: str | None = None  # the new attempt's first observation
        self.phase = "act"  # act | reflect (the next reply is a reflection) | reflected

    def act(self, reply: str) -> Move:
        if self.phase == "reflect":
            self.phase = "reflected"
            return Move(None, f"{RESTART}\n\n{self.first}")
        return super().act(reply)

    def observe(self, text: str, reward: float | None, done: bool, turns: int) -> tuple[str, str | None]:
        if self.phase == "reflected":  # the reflection's answer: the new attempt's first observation
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


SCHEMES = {cls.name: cls for cls in (React, Plan, Reflect)}


def make_agent(scheme: str, env: str, max_turns: int) -> React:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown agent scheme {scheme!r}; choose from {sorted(SCHEMES)}")
    return SCHEMES[scheme](env, max_turns)
