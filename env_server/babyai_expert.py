"""BabyAI's expert: minigrid's BabyAI bot, its low-level actions translated into the text actions
of env_server/babyai.py. A mixin of BabyAIEnv: it reads the episode's level, the cells seen and the
text actions on offer through BabyAIEnv's own methods."""

from __future__ import annotations

import copy

import numpy as np
from minigrid.envs.babyai.core.verifier import AfterInstr, AndInstr, BeforeInstr, PutNextInstr
from minigrid.utils.baby_ai_bot import (DisappearedBoxError, DropSubgoal, GoNextToSubgoal,
                                        PickupSubgoal)

from .babyai_mends import Bot

# minigrid's low-level actions, and its directions (0 = +x, 1 = +y, 2 = -x, 3 = -y; "right" is
# dir + 1).
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
MOVES = (LEFT, RIGHT, FORWARD)
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))
LOOKAHEAD = 64  # low-level steps the expert simulates its bot for: no text action walks further


class Expert:
    """BabyAIEnv's expert: minigrid's BabyAI bot, translated into text actions."""

    def expert_action(self) -> str | None:
        """The expert's next text action from the current state (None: it has no plan).

        The bot plays a copy of the current state up to just past its next interaction (pickup,
        drop, toggle) or reached goal. We choose the text action that lands on the latest state of
        that simulated trajectory, fewest low-level steps first, so "go to"/"pickup" plans replace
        runs of primitives. When that action is taken, the bot, advanced to the same state, carries
        its plan over to the next call; from any other state a fresh bot plans what is left of the
        instruction. The expert is slightly privileged: cells its bot saw on the way count as seen
        for later bots.
        """
        self._require_task()
        if self._done:
            return None
        if self._expert_memo[0] == self._turns:  # asked again in the same state
            return self._expert_memo[1]
        box = next((o for o in self._env.grid.grid if o is not None and o.type == "box"
                    and o.contains is not None and o.contains.type == "key"), None)
        if box is not None:  # KeyInBox: the bot cannot open boxes, so open it first
            return self._open_box(box)
        if self._unlocking is not None and self._env.grid.get(*self._unlocking).is_locked:
            return self._unlock()  # the bot failed here before: finish opening the door first
        # The carried bot, else a fresh one that counts the cells earlier bots saw, else one that
        # does not: a bot can give up, think it is done, or circle (on what others saw), and the
        # carried one can count a part of the instruction as done that minigrid, checking the
        # order, does not.
        for attempt in ("carried", "fresh", "honest"):
            try:
                started = self._expert_bot(attempt)
                if started is None:
                    continue
                env, bot, low = started
                states, actions, limit, success = self._simulate(*copy.deepcopy((env, bot)), low)
            except (AssertionError, DisappearedBoxError):
                continue
            label, reached = self._match(states, actions, limit, success)
            if label is not None:
                break
        else:
            self._carried = None
            return self._unlock()
        self._carried = None
        if not (success and reached == len(actions)):
            try:
                for action in actions[:reached]:  # the bot's own way to the state we will be in
                    env.step(action)
                    low = bot.replan(action)
                self._carried = (env, bot, low)
            except (AssertionError, DisappearedBoxError):
                pass  # lost there: the next call starts a fresh bot
            self._skipped |= bot.vis_mask
        self._expert_memo = (self._turns, label)
        return label

    def _open_box(self, box) -> str | None:
        if tuple(self._env.front_pos) == tuple(box.cur_pos):
            return "toggle"
        return self._towards(box.cur_pos, "go to", known=np.ones_like(self._seen))

    def _unlock(self) -> str | None:
        """For when the bot circles, as when it picks a locked door whose key it has not seen (it
        does not try another): open a seen locked door whose key is seen, sticking to it until
        open."""
        env, held = self._env, self._env.carrying
        cells = [((i % env.width, i // env.width), o) for i, o in enumerate(env.grid.grid)
                 if o is not None]
        keys = {o.color: pos for pos, o in cells if o.type == "key" and self._seen[pos]}
        doors = [(pos, o) for pos, o in cells
                 if o.type == "door" and o.is_locked and self._seen[pos]]
        doors.sort(key=lambda door: door[0] != self._unlocking)  # the one chosen before, if locked
        for pos, door in doors:
            if held is not None and (held.type, held.color) == ("key", door.color):
                self._unlocking = pos
                return self._towards(pos, "toggle and go through")
            if held is None and door.color in keys:
                self._unlocking = pos
                return self._towards(keys[door.color], "pickup")
        self._unlocking = None
        return None

    def _towards(self, pos, verb: str, known=None) -> str | None:
        """'<verb> <obj> <n>' for the object at `pos` when available, else the first primitive of a
        path that ends facing it (through the `known` cells, default: seen)."""
        info = self._analyse()
        for name, n, _, _, at, _ in info["objects"]:
            if tuple(at) == tuple(pos) and f"{verb} {name} {n}" in info["actions"]:
                return f"{verb} {name} {n}"
        path = self._path_facing(self._bfs(known), pos)
        if not path:
            return None
        return {LEFT: "turn left", RIGHT: "turn right", FORWARD: "move forward"}[path[0]]

    def _expert_bot(self, attempt: str):
        """(copy of the level, its bot, the bot's next action) for an attempt of expert_action; None
        for "carried" when no bot was carried to this state."""
        env = copy.deepcopy(self._env)
        if attempt == "carried":
            if self._carried is None or not self._same_state(self._carried[0]):
                return None
            old_env, old_bot, low = self._carried
            # Re-point the bot at the new copy, whose instructions know what the agent really did.
            memo = {id(old_env): env, id(old_env.carrying): env.carrying}
            memo.update((id(old), new) for old, new in zip(old_env.grid.grid, env.grid.grid))
            pairs = [(old_env.instrs, env.instrs)]
            while pairs:
                old, new = pairs.pop()
                memo[id(old)] = new
                for attr in ("desc", "desc_move", "desc_fixed", "instr_a", "instr_b"):
                    if hasattr(old, attr):
                        pairs.append((getattr(old, attr), getattr(new, attr)))
            return env, copy.deepcopy(old_bot, memo), low
        bot = self._new_bot(env, self._seen if attempt == "honest" else self._seen | self._skipped)
        return env, bot, bot.replan()

    def _same_state(self, other) -> bool:
        env = self._env
        held = lambda e: e.carrying and (e.carrying.type, e.carrying.color)  # noqa: E731
        return (tuple(other.agent_pos) == tuple(env.agent_pos) and other.agent_dir == env.agent_dir
                and held(other) == held(env)
                and np.array_equal(other.grid.encode(), env.grid.encode()))

    def _new_bot(self, env, known) -> Bot:
        """A bot on `env` that knows the `known` cells and plans only the unfinished
        instructions."""
        bot = Bot(env)
        bot.vis_mask = known.copy()
        bot.stack = []
        held, keep = env.carrying, False

        def push(instr):  # as BabyAIBot._process_instr, skipping the parts minigrid has verified
            nonlocal keep
            if isinstance(instr, (BeforeInstr, AfterInstr, AndInstr)):
                parts = [(instr.instr_a, instr.a_done), (instr.instr_b, instr.b_done)]
                if isinstance(instr, AfterInstr):
                    parts.reverse()  # "a after you b": b comes first
                for part, done in reversed(parts):  # a stack: the first part goes on top
                    if done != "success":
                        push(part)
                return
            bot._process_instr(instr)
            if isinstance(instr, PutNextInstr) and any(o is held for o in instr.desc_move.obj_set):
                del bot.stack[-2:]  # already holding the object to move: no "go to it, pick it up"
                keep = True

        push(env.instrs)
        # Free the hands for a pickup to come, unless holding a key that still opens a locked door
        # (a bot that had fetched it would keep it until the door is open, then drop it).
        needed = held is not None and held.type == "key" and any(
            o is not None and o.type == "door" and o.is_locked and o.color == held.color
            for o in env.grid.grid)
        pickup_ahead = any(isinstance(g, PickupSubgoal) for g in bot.stack)
        if held and not keep and not needed and pickup_ahead:
            bot.stack += [DropSubgoal(bot), GoNextToSubgoal(bot, bot._find_drop_pos())]
        return bot

    @staticmethod
    def _simulate(env, bot, low):
        """Let the bot play `env`, starting with its suggested action `low`.

        Returns its states (x, y, dir), its actions, the index `limit` of the first state where it
        interacts or reaches a non-exploratory goal (a shortcut past it could skip part of the
        instruction), and whether it succeeded. states[j] is the state before actions[j].
        """
        def goals():
            return {id(g) for g in bot.stack
                    if isinstance(g, GoNextToSubgoal) and not g.is_exploratory()}

        def state():
            return int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir)

        states, actions, success, limit = [], [], False, None
        while len(actions) < LOOKAHEAD and low != DONE:
            states.append(state())
            actions.append(int(low))
            if limit is None and low not in MOVES:
                limit = len(actions) - 1
            _, reward, terminated, truncated, _ = env.step(low)
            if terminated or truncated:
                success = reward > 0
                break
            if limit is not None and len(actions) >= limit + 2:
                break  # enough to see whether a toggle is followed by a step through the door
            before = goals()
            try:
                low = bot.replan(low)
            except (AssertionError, DisappearedBoxError):
                break  # the bot is lost from here on; the way here is still good
            if limit is None and not before <= goals():
                limit = len(actions)  # a goal was reached in the state after this action
        states.append(state())
        return states, actions, len(actions) if limit is None else limit, success

    def _match(self, states, actions, limit, success) -> tuple[str | None, int]:
        """The text action reaching the furthest state of the bot's trajectory, and that state's
        index."""
        n, (x0, y0, d0) = len(actions), states[0]
        best, best_key = None, (0, 0)
        for label, plan in self._analyse()["actions"].items():
            x, y, d, k = x0, y0, d0, 0
            while k < len(plan) and plan[k] in MOVES:  # dead reckoning: plans only enter free cells
                if plan[k] == FORWARD:
                    x, y = x + DIR_VEC[d][0], y + DIR_VEC[d][1]
                else:
                    d = (d + (1 if plan[k] == RIGHT else -1)) % 4
                k += 1
            rest, end, reached = plan[k:], (x, y, d), 0
            if plan and not rest:  # the first visit: a later one comes back from a detour
                reached = next((j for j in range(1, limit + 1) if states[j] == end), 0)
            elif rest and limit < n and states[limit] == end:
                if actions[limit:limit + len(rest)] == rest:
                    reached = limit + len(rest)
                elif limit == n - 1 and success and rest[0] == actions[limit]:
                    reached = n  # the interaction wins the episode; the rest of the plan never runs
            if reached > 0 and (reached, -len(plan)) > best_key:
                best, best_key = label, (reached, -len(plan))
        return best, best_key[0]

