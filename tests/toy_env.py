"""A tiny deterministic game for testing the generic server: reach `target` by sending "add N".

It is also the template for a new environment: an `Env` subclass (env_server/base.py says what each
method must do) and one `register_env` call that names its class, the instructions that open every
episode, and the parser that turns a reply into an action (agents.py has the parsers the built-in
games use). Put the class in env_server/NAME.py and the call in agents.py, next to the others, and
`python -m env_server NAME`, train.py, eval.py and sft.py all know the game.
"""

import time

from env_server.agents import parse_thought_action, register_env
from env_server.base import Env, StepResult, TaskError


class CounterEnv(Env):
    name = "counter"

    @classmethod
    def load_world(cls, args=None):
        return {"targets": [3 + i % 5 for i in range(19)] + [10**6]}  # task 19: endless

    @classmethod
    def num_tasks(cls, world):
        return len(world["targets"])

    @classmethod
    def splits(cls, world):
        return {"train": list(range(15)), "test": list(range(15, 20))}

    def reset(self, idx):
        self.target, self.total, self.turns = self.world["targets"][idx], 0, 0
        return f"Reach {self.target}."

    def step(self, action):
        if action == "crash":
            raise RuntimeError("a bug in the game")  # the server must answer 500 and keep serving
        if action == "refuse":
            raise TaskError("the game refuses this", 422)
        if action.startswith("sleep "):
            time.sleep(float(action.split()[1]))  # a hung game, for client timeouts
            return StepResult("slept", 0.0, False)
        if action == "slowadd":
            # read-modify-write with a pause: two interleaved calls would lose an update without the
            # server's per-instance lock
            total = self.total
            time.sleep(0.001)
            self.total = total + 1
            return StepResult(f"Total: {self.total}", 0.0, False)
        self.turns += 1
        parts = action.split()
        if len(parts) != 2 or parts[0] != "add" or not parts[1].isdigit():
            return StepResult(f"Could not execute {action}", 0.0, False)
        self.total += int(parts[1])
        done = self.total >= self.target
        reward = 1.0 if self.total == self.target else 0.0
        return StepResult(f"Total: {self.total}", reward, done, info={"turns": self.turns})

    def observation(self):
        return f"Total: {self.total}"

    def available_actions(self):
        return ["add N"]

    def expert_action(self):
        return f"add {self.target - self.total}"

    def detail(self):
        return {"target": getattr(self, "target", None), "total": getattr(self, "total", None)}


register_env("counter", server=CounterEnv, parse_action=parse_thought_action, instructions=(
    "Reach the target number. Each turn add a number to the total.\n"
    "Answer in this format:\nThought: <your reasoning>\nAction: add <number>"))
