"""GiGPO (algos.gigpo_advantages, the "gigpo" estimator) against numbers worked out by hand and a
naive Python loop; rollout's per-turn inputs to it (turn_ids, turn_state_keys, turn_rewards)."""

import math
import random
import statistics
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import algos
import train
from env_client import Step
from env_server.agents import REFLECT_ASK, RESTART
from distributed import build_batch
from rollout import Reply, RolloutConfig, Trajectory, rollout, turn_state_keys

EPS = 1e-6  # GRPO's eps, which GiGPO's two levels share


def gigpo(turn_ids, scores, groups, keys, turn_rewards=None, gamma=0.5, w=1.0, norm_std=True,
          episode_stat="trajectory"):
    tid = torch.tensor(turn_ids)
    return algos.gigpo_advantages(torch.tensor(scores), torch.tensor(groups), tid >= 0, tid, keys,
                                  turn_rewards, gamma, w, norm_std=norm_std,
                                  episode_stat=episode_stat)


def run_estimator(name, turn_ids, scores, groups, keys, turn_rewards=None, gamma=0.95, w=1.0):
    tid = torch.tensor(turn_ids)
    x = algos.AdvantageInputs(torch.tensor(scores), torch.tensor(groups), (tid >= 0).float(),
                              gamma=gamma, turn_ids=tid, state_keys=keys, turn_rewards=turn_rewards,
                              step_adv_weight=w)
    adv, returns = algos.estimator(name).fn(x)
    assert returns is None
    return adv


# ------------------------------------------------------------------------------- by hand
# Two groups with the same state texts, gamma 0.5 (exact in binary), the outcome on each row's last
# turn.
# Turn ids per token (-1: prompt, observation, padding); K = 3 turns at most (the horizon).
HAND_TURN_IDS = [
    [-1, 0, 0, -1, 1, -1, -1, -1],  # row 0, group 7: states S, A; done in 2 turns, score 1
    [-1, 0, -1, 1, 1, -1, 2, -1],   # row 1, group 7: S, A, A; cut by the horizon (3 turns), score 0
    [-1, 0, -1, 1, -1, 2, 2, 2],    # row 2, group 7: S, B, A; done on its last turn, score 1
    [-1, -1, 0, -1, 1, -1, -1, -1],  # row 3, group 3: S, A; score 0
    [-1, 0, -1, -1, 1, 1, -1, -1],  # row 4, group 3: S, D; score 1
]
HAND_KEYS = [["S", "A"], ["S", "A", "A"], ["S", "B", "A"], ["S", "A"], ["S", "D"]]
HAND_SCORES = [1.0, 0.0, 1.0, 0.0, 1.0]
HAND_GROUPS = [7, 7, 7, 3, 3]


def hand_expected():
    # Returns from each turn, G_k = sum_{j>=k} 0.5^(j-k) r_j, r = the score on the last turn:
    #   row 0: [0.5, 1]   row 1: [0, 0, 0]   row 2: [0.25, 0.5, 1]   row 3: [0, 0]   row 4: [0.5, 1]
    # Episode level (GRPO): group 7 scores 1, 0, 1: mean 2/3,
    #   unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
    e0 = (1 / 3) / (math.sqrt(1 / 3) + EPS)  # rows 0 and 2
    e1 = (-2 / 3) / (math.sqrt(1 / 3) + EPS)  # row 1
    #   group 3 scores 0, 1: mean 1/2, var (1/4 + 1/4) / 1 = 1/2
    e3, e4 = -0.5 / (math.sqrt(0.5) + EPS), 0.5 / (math.sqrt(0.5) + EPS)
    # Step level, anchor groups of group 7:
    #   S at turn 0 of rows 0, 1, 2: G 0.5, 0, 0.25: mean 0.25, var (1/16 + 1/16 + 0) / 2 = 1/16
    s7 = 0.25 / (0.25 + EPS)  # row 0: +s7, row 1: -s7, row 2: 0
    #   A at turn 1 of rows 0 and 1, turn 2 of rows 1 and 2 (the same state at other turn
    #   indices, and twice in row 1): G 1, 0, 0, 1: mean 1/2, var 4 * (1/4) / 3 = 1/3
    a7 = 0.5 / (math.sqrt(1 / 3) + EPS)
    #   B (row 2, turn 1): a group of one -> 0
    # Anchor groups of group 3 (the texts S and A again, but never pooled with group 7's):
    #   S at turn 0 of rows 3 and 4: G 0, 0.5: mean 1/4, var (1/16 + 1/16) / 1 = 1/8
    s3 = 0.25 / (math.sqrt(1 / 8) + EPS)
    #   A (row 3, turn 1) and D (row 4, turn 1): groups of one -> 0. (Pooled with group 7's A,
    #   row 3's turn would get (0 - 2/5) / std < 0.)
    return torch.tensor([
        [0, e0 + s7, e0 + s7, 0, e0 + a7, 0, 0, 0],
        [0, e1 - s7, 0, e1 - a7, e1 - a7, 0, e1 - a7, 0],
        [0, e0, 0, e0, 0, e0 + a7, e0 + a7, e0 + a7],
        [0, 0, e3 - s3, 0, e3, 0, 0, 0],
        [0, e4 + s3, 0, 0, e4, e4, 0, 0],
    ])


def test_gigpo_by_hand():
    adv = gigpo(HAND_TURN_IDS, HAND_SCORES, HAND_GROUPS, HAND_KEYS, gamma=0.5)
    assert adv.dtype == torch.float32
    assert_close(adv, hand_expected())
    # the registered estimator is the same function of AdvantageInputs
    adv = run_estimator("gigpo", HAND_TURN_IDS, HAND_SCORES, HAND_GROUPS, HAND_KEYS, gamma=0.5)
    assert_close(adv, hand_expected())


def test_gigpo_per_turn_rewards_and_mean_only_by_hand():
    # One group. Row 0: states S, X with turn rewards 0.5, 0.5 (partial credit, as SciWorld's
    # score); row 1: state S, reward 0.25. gamma 0.5 -> G row 0: [0.5 + 0.5 * 0.5, 0.5] =
    # [0.75, 0.5], row 1: [0.25]. Mean only (norm_std=False): episode: scores 1, 0.25, mean 0.625
    # -> +-0.375; S: G 0.75, 0.25, mean 0.5 -> +-0.25; X alone -> 0.
    turn_ids = [[-1, 0, -1, 1], [-1, 0, 0, -1]]
    args = (turn_ids, [1.0, 0.25], [0, 0], [["S", "X"], ["S"]])
    adv = gigpo(*args, turn_rewards=[[0.5, 0.5], [0.25]], gamma=0.5, norm_std=False)
    assert_close(adv, torch.tensor([[0, 0.375 + 0.25, 0, 0.375], [0, -0.375 - 0.25, -0.625, 0]]))
    # The outcome on the last turn instead: G row 0 [0.5, 1], row 1 [0.25]: S: mean 0.375 -> +-0.125
    adv = gigpo(*args, turn_rewards=None, gamma=0.5, norm_std=False)
    assert_close(adv, torch.tensor([[0, 0.375 + 0.125, 0, 0.375], [0, -0.5, -0.5, 0]]))
    # step_adv_weight scales the step level only: 0.375 + 2 * 0.125
    adv = gigpo(*args, turn_rewards=None, gamma=0.5, w=2.0, norm_std=False)
    assert_close(adv[0, 1], torch.tensor(0.625))


def test_the_episode_statistic_over_trajectories_or_over_step_rows_by_hand():
    """Departure 10. One group: row 0 scores 1 in 1 turn, row 1 scores 0 in 3 turns; the step
    level off (w 0), so only the episode level is seen, on every sampled token of its row."""
    turn_ids = [[-1, 0, 0, -1, -1, -1, -1], [-1, 0, -1, 1, -1, 2, 2]]
    args = (turn_ids, [1.0, 0.0], [5, 5], [["S"], ["S", "X", "Y"]])
    m = torch.tensor(turn_ids) >= 0

    def on_tokens(a0, a1):
        return torch.tensor([[a0], [a1]]) * m

    # Mean only. Over trajectories (Eq. 3): scores 1, 0, mean 1/2 -> +0.5, -0.5. Over step rows
    # (verl-agent): 1, 0, 0, 0, mean 1/4 -> +0.75, -0.25.
    assert_close(gigpo(*args, w=0.0, norm_std=False), on_tokens(0.5, -0.5))
    assert_close(gigpo(*args, w=0.0, norm_std=False, episode_stat="step"), on_tokens(0.75, -0.25))
    # With the std. Trajectories: std sqrt(1/2) -> +-0.5 / (sqrt(1/2) + eps). Step rows: unbiased
    # var (0.75^2 + 3 * 0.25^2) / 3 = 1/4, std 1/2 -> 0.75 / 0.5 = 1.5 and -0.25 / 0.5 = -0.5.
    e = 0.5 / (math.sqrt(0.5) + EPS)
    assert_close(gigpo(*args, w=0.0), on_tokens(e, -e))
    assert_close(gigpo(*args, w=0.0, episode_stat="step"),
                 on_tokens(0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)))
    # A group of one row: its raw score over trajectories (departure 4); over step rows a 3-turn
    # row is a group of 3 equal rows (std 0) -> 0, a 1-turn row a group of one -> its raw score.
    alone = ([turn_ids[1]], [2.0], [5], [["S", "X", "Y"]])
    assert_close(gigpo(*alone, w=0.0), torch.tensor([[2.0 / (1 + EPS)]]) * m[1:])
    assert_close(gigpo(*alone, w=0.0, episode_stat="step"), torch.zeros(1, 7))
    one = ([turn_ids[0]], [2.0], [5], [["S"]])
    assert_close(gigpo(*one, w=0.0, episode_stat="step"), torch.tensor([[2.0 / (1 + EPS)]]) * m[:1])
    # The step level is the same either way: the shared first state S, G 1 and 0 (gamma 0.5: row
    # 1's G at turn 0 is 0.25 * 0), mean only -> +-0.5 on each row's turn 0.
    step = gigpo(*args, norm_std=False) - gigpo(*args, w=0.0, norm_std=False)
    assert_close(step, gigpo(*args, norm_std=False, episode_stat="step")
                 - gigpo(*args, w=0.0, norm_std=False, episode_stat="step"))
    assert_close(step, torch.tensor([[0, 0.5, 0.5, 0, 0, 0, 0], [0, -0.5, 0, 0, 0, 0, 0]]))
    with pytest.raises(AssertionError, match="episode_stat 'turn': trajectory|step"):
        gigpo(*args, episode_stat="turn")


@pytest.mark.parametrize("seed", range(10))
def test_equal_turn_counts_make_the_two_episode_means_equal(seed):
    """Every row with k turns: each counts k times over step rows, so the group mean is the same;
    mean only, the two statistics agree (with the std they do not: n k - 1 against n - 1)."""
    rng = random.Random(seed)
    k, B = rng.randint(1, 4), rng.randint(4, 8)
    turn_ids = [random_layout(rng, k) for _ in range(B)]
    T = max(map(len, turn_ids))
    turn_ids = [r + [-1] * (T - len(r)) for r in turn_ids]
    keys = [[rng.choice("ab") for _ in range(k)] for _ in range(B)]
    scores, groups = [rng.uniform(-1, 2) for _ in range(B)], [b % 2 for b in range(B)]  # of 2+
    args = (turn_ids, scores, groups, keys)
    assert_close(gigpo(*args, norm_std=False), gigpo(*args, norm_std=False, episode_stat="step"))


# ----------------------------------------------------------------------------- equals GRPO
def random_layout(rng: random.Random, n_turns: int) -> list[int]:
    """Turn ids of a row: a prompt, then each turn's sampled tokens and an observation after it."""
    row = [-1] * rng.randint(1, 2)
    for k in range(n_turns):
        row += [k] * rng.randint(1, 3) + [-1] * rng.randint(1, 2)
    return row


def random_batch(rng: random.Random, alphabet: str = "abc", max_turns: int = 5):
    """Rows of random groups (some of one row), turns (some rows with none), keys drawn from
    `alphabet` (few letters: states repeat), token layouts, scores and per-turn rewards."""
    B = rng.randint(1, 8)
    groups = [rng.choice([-1, 0, 4, 9]) for _ in range(B)]
    n = [rng.randint(0, max_turns) for _ in range(B)]
    rows = [random_layout(rng, k) for k in n]
    T = max(map(len, rows))
    turn_ids = [r + [-1] * (T - len(r)) for r in rows]
    keys = [[rng.choice(alphabet) for _ in range(k)] for k in n]
    scores = [rng.choice([0.0, 1.0, rng.uniform(-1, 2)]) for _ in range(B)]
    turn_rewards = [[rng.choice([0.0, rng.uniform(-1, 1)]) for _ in range(k)] for k in n]
    return turn_ids, scores, groups, keys, turn_rewards


@pytest.mark.parametrize("seed", range(20))
def test_no_repeated_state_is_grpo(seed):
    rng = random.Random(seed)
    turn_ids, scores, groups, keys, turn_rewards = random_batch(rng)
    unique = [[f"{b}.{k}" for k in range(len(row))] for b, row in enumerate(keys)]  # all alone
    grpo = run_estimator("grpo", turn_ids, scores, groups, unique)
    for rewards in (None, turn_rewards):
        adv = run_estimator("gigpo", turn_ids, scores, groups, unique, rewards, gamma=0.95, w=1.0)
        assert torch.equal(adv, grpo)


@pytest.mark.parametrize("seed", range(20))
def test_step_adv_weight_zero_is_grpo(seed):
    rng = random.Random(seed)
    turn_ids, scores, groups, keys, turn_rewards = random_batch(rng, alphabet="a")  # all one state
    grpo = run_estimator("grpo", turn_ids, scores, groups, keys)
    adv = run_estimator("gigpo", turn_ids, scores, groups, keys, turn_rewards, w=0.0)
    assert torch.equal(adv, grpo)


# --------------------------------------------------------------------------- naive loop
def naive_gigpo(turn_ids, scores, groups, keys, turn_rewards, gamma, w, norm_std,
                episode_stat="trajectory"):
    """The paper's formulas, one number at a time, in float64; episode_stat "step": the episode
    level's statistic over one copy of each row per turn, as verl-agent's step rows."""
    def normalise(values):  # GRPO's: mean 0 and std 1 for a group of one (the episode level's rule)
        if len(values) < 2:
            return [v / (1 + EPS) if norm_std else v for v in values]
        mean, std = statistics.mean(values), statistics.stdev(values)
        return [(v - mean) / (std + EPS) if norm_std else v - mean for v in values]

    B = len(scores)
    episode = [0.0] * B
    for g in set(groups):
        rows = [b for b in range(B) if groups[b] == g]
        if episode_stat == "step":  # a row without a turn has no token to carry its value
            rows = [b for b in rows for _ in keys[b]]
        for b, a in zip(rows, normalise([scores[b] for b in rows])):
            episode[b] = a
    returns = []
    for b in range(B):
        n = len(keys[b])
        r = turn_rewards[b] if turn_rewards is not None else [0.0] * (n - 1) + [scores[b]] * (n > 0)
        returns.append([sum(gamma ** (j - k) * r[j] for j in range(k, n)) for k in range(n)])
    anchors: dict = {}
    for b in range(B):
        for k, key in enumerate(keys[b]):
            anchors.setdefault((groups[b], key), []).append((b, k))
    step = {}
    for members in anchors.values():
        values = normalise([returns[b][k] for b, k in members])
        for (b, k), a in zip(members, values):
            step[b, k] = a if len(members) > 1 else 0.0  # a state met once: nothing to compare
    return [[episode[b] + w * step[b, k] if k >= 0 else 0.0 for k in row]
            for b, row in enumerate(turn_ids)]


@pytest.mark.parametrize("seed", range(60))  # seeds 30-59 with the episode statistic over turns
def test_gigpo_matches_a_naive_loop(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abcd"  # many repeated states, or fewer
    turn_ids, scores, groups, keys, turn_rewards = random_batch(rng, alphabet)
    rewards = turn_rewards if seed % 3 else None
    gamma, w, norm_std = rng.choice([1.0, 0.95, 0.5]), rng.choice([1.0, 0.5, 2.0]), seed % 4 != 1
    stat = ("trajectory", "step")[seed // 30]
    adv = gigpo(turn_ids, scores, groups, keys, rewards, gamma, w, norm_std, stat)
    expected = naive_gigpo(turn_ids, scores, groups, keys, rewards, gamma, w, norm_std, stat)
    assert_close(adv, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-5)


def test_gigpo_refuses_inconsistent_inputs():
    turn_ids, keys = [[-1, 0, -1, 1]], [["S", "X"]]
    with pytest.raises(ValueError, match="turns per row"):
        gigpo(turn_ids, [1.0], [0], [["S"]])
    with pytest.raises(ValueError, match="turn rewards for 2 turns"):
        gigpo(turn_ids, [1.0], [0], keys, turn_rewards=[[1.0]])
    tid = torch.tensor(turn_ids)
    with pytest.raises(ValueError, match="shift them"):  # turn ids not shifted as the mask was
        algos.gigpo_advantages(torch.ones(1), torch.zeros(1), (tid >= 0)[:, 1:], tid[:, :-1], keys)
    with pytest.raises(ValueError, match="needs turn_ids"):  # inputs without GiGPO's fields
        algos.estimator("gigpo").fn(algos.AdvantageInputs(torch.ones(1), torch.zeros(1), tid >= 0))
    with pytest.raises(ValueError, match="finite"):
        gigpo(turn_ids, [1.0], [0], keys, turn_rewards=[[1.0, float("nan")]])


# ------------------------------------------------------------------------ rollout's side
def test_build_batch_turn_ids_are_the_loss_mask_runs():
    rng = random.Random(0)
    trajs = []
    for b in range(12):
        mask = [0] * rng.randint(1, 3)
        for _ in range(rng.randint(0, 5)):  # a reply (a run of 1s), then an observation (0s)
            mask += [1] * rng.randint(1, 4) + [0] * rng.randint(1, 3)
        if rng.random() < 0.5 and mask[-1] == 0 and 1 in mask:  # the last reply ends the row
            while mask[-1] == 0:
                mask.pop()
        trajs.append(Trajectory("x", b, b % 3, [], list(range(len(mask))), mask, [0.0] * len(mask)))
    turn_ids = build_batch(trajs, pad_id=0)["turn_ids"]
    assert turn_ids.dtype == torch.long
    for b, t in enumerate(trajs):
        expected, k = [], -1
        for i, m in enumerate(t.loss_mask):
            k += bool(m and (i == 0 or not t.loss_mask[i - 1]))  # a run of 1s starts: the next turn
            expected.append(k if m else -1)
        expected += [-1] * (turn_ids.shape[1] - len(expected))  # padding
        assert turn_ids[b].tolist() == expected


class FakePool:
    """One env instance answering a script of steps; None actions (no step) are not sent."""

    size = 1

    def __init__(self, first: str, steps: list[tuple[str, float, bool]]):
        self.first, self.steps = first, list(steps)

    def reset(self, items):
        return [self.first if i is not None else None for i in items]

    def step(self, actions):
        return [Step(*self.steps.pop(0)) if a is not None else None for a in actions]


class SameReply:
    def replies(self, trajs, slots):
        return [Reply("Thought: go.\nAction: add 1") for _ in trajs]


def test_a_reflect_trajectory_gives_per_turn_keys_and_rewards_that_sum_to_its_reward():
    # reflect, 5 turns, 2 attempts of 2 turns: the first attempt earns 0.3 then 0.5 (a running
    # score, as SciWorld's) and fails; the env is reset (reward 0); a reflection turn (no step);
    # then the second attempt succeeds at once.
    pool = FakePool("Reach 3.", [("Total: 1", 0.3, False), ("Total: 2", 0.5, False),
                                 ("Total: 3", 1.0, True)])
    cfg = RolloutConfig(max_turns=5)
    [t] = rollout(SameReply(), pool, "counter", [0], [0], cfg, agent="reflect")
    assert t.status == "done" and t.turns == 4 and t.reward == 1.0
    # each turn's change of the reward: +0.3; +0.2 then the reset's -0.5; 0 (no step); +1
    assert_close(t.turn_rewards, [0.3, -0.3, 0.0, 1.0])
    assert math.isclose(sum(t.turn_rewards), t.reward)
    # the user message before each reply; the opening's acknowledgement is no sampled turn
    assert turn_state_keys(t) == ["Reach 3.", "Total: 1", f"Total: 2\n\n{REFLECT_ASK}",
                                  f"{RESTART}\n\nReach 3."]
    assert turn_state_keys(t, reported=["s0", "s1", "s2", "s0"]) == ["s0", "s1", "s2", "s0"]
    with pytest.raises(ValueError):
        turn_state_keys(t, reported=["s0"])


def hand_trajectories() -> list[Trajectory]:
    """The by-hand batch as trajectories: user messages are the state keys, rows laid out as
    HAND_TURN_IDS (one more prompt token in front, which the trainer's shift drops)."""
    trajs = []
    for b, (row, keys) in enumerate(zip(HAND_TURN_IDS, HAND_KEYS)):
        messages = [{"role": "user", "content": "instructions"},
                    {"role": "assistant", "content": "OK"}]  # the opening's unsampled ack
        for k, key in enumerate(keys):
            messages += [{"role": "user", "content": key},
                         {"role": "assistant", "content": f"reply {k}"}]
        mask = [0] + [int(k >= 0) for k in row]
        t = Trajectory("x", 0, HAND_GROUPS[b], messages, list(range(len(mask))), mask,
                       [0.0] * len(mask), turns=len(keys), status="done", reward=HAND_SCORES[b])
        t.turn_rewards = [0.0] * (len(keys) - 1) + [HAND_SCORES[b]]
        trajs.append(t)
    return trajs


def test_the_trainer_fills_gigpos_inputs_from_a_batch_and_its_trajectories():
    """train.advantages on the by-hand batch plus a row without turns (the blank row Rows adds under
    torchrun; a row cut by --max-context before its first reply): the hand values, 0 on it."""
    blank = Trajectory("", -1, -1, [], [0, 0], [0, 0], [0.0, 0.0])
    trajs = hand_trajectories() + [blank]
    batch = build_batch(trajs, pad_id=0)
    assert batch["turn_ids"][:-1, 1:].tolist() == HAND_TURN_IDS
    cfg = train.parse_args(["--env", "corridor", "--algo", "gigpo", "--gamma", "0.5"])
    adv, _, _ = train.advantages(SimpleNamespace(cfg=cfg, critic=None),
                                 SimpleNamespace(batch=batch, trajs=trajs))
    assert_close(adv[:-1], hand_expected())
    assert not adv[-1].any()
