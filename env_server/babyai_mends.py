"""Two mends of minigrid's BabyAI code that env_server/babyai.py plays on: missions in order whose
second part is strict (OpenDoorsOrderN4Debug's could not be won), and a bot that gives up instead of
circling."""

from __future__ import annotations

from minigrid.envs.babyai.core.verifier import AfterInstr, BeforeInstr
from minigrid.utils.baby_ai_bot import BabyAIBot


def verify_in_order(seq, action, first: str, second: str, minigrid_verify) -> str:
    """minigrid's verify of a two-part mission in order ("A, then B"; "A after you B", B first), but
    the second part is first checked on the action after the one that finished the first. minigrid
    also checks that action against the second part, and a strict one (OpenDoorsOrderN4Debug's
    OpenInstr fails on any other door in front) fails on the door just opened. `first`, `second`:
    the parts' letters, "a" or "b"."""
    done = f"{first}_done"
    if getattr(seq, done) == "success":
        return minigrid_verify(action)
    setattr(seq, done, getattr(seq, f"instr_{first}").verify(action))
    if getattr(seq, done) == "success":
        return "continue"
    failed = getattr(seq, done) == "failure" or (
        seq.strict and getattr(seq, f"instr_{second}").verify(action) == "success")
    return "failure" if failed else "continue"


class InOrderBefore(BeforeInstr):
    def verify(self, action):
        return verify_in_order(self, action, "a", "b", super().verify)


class InOrderAfter(AfterInstr):
    def verify(self, action):
        return verify_in_order(self, action, "b", "a", super().verify)


def mend_order(instrs) -> None:
    """Swap a two-part mission whose second part is strict for its InOrder class (verify_in_order),
    in place."""
    if type(instrs) is BeforeInstr and getattr(instrs.instr_b, "strict", False):
        instrs.__class__ = InOrderBefore
    elif type(instrs) is AfterInstr and getattr(instrs.instr_a, "strict", False):
        instrs.__class__ = InOrderAfter


class Bot(BabyAIBot):
    """minigrid's BabyAI bot, made to give up (AssertionError, as the bot's own failures) rather
    than loop forever inside one replan, as it can when all doors left are locked and no key is in
    sight."""

    searches = 0  # breadth-first searches in the current replan

    def replan(self, action_taken=None):
        self.searches = 0
        return super().replan(action_taken)

    def _breadth_first_search(self, *args, **kwargs):
        self.searches += 1
        assert self.searches <= 100, "the bot is going round in circles"
        return super()._breadth_first_search(*args, **kwargs)
