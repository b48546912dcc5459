"""The RL update's formulas: advantages, policy and value losses, KL estimators, entropy,
log-probs, loss aggregation, and the trainer's log-prob of a sampled token (`token_logprobs`,
the one that runs a model). torch only: each formula can be tested against hand numbers.

Shapes (one legend for the whole file):
    B  trajectories in the batch; one row each (a whole multi-turn conversation is one row)
    T  tokens per row (padded)
    G  group size: copies of one task sampled together (GRPO / RLOO groups share a `group_id`)
    V  vocabulary size
    K  assistant turns per row (padded; GiGPO's step level works per turn, not per token)
`loss_mask` (B, T) is 1 exactly on the tokens the policy sampled, 0 on prompt, observation
and padding tokens (bool, integer or float 0/1). Per-token tensors are aligned with their
token. Inputs may be float32 or bfloat16; statistics and every returned tensor are float32
(bf16's three significant digits are too few for an importance ratio or a whitened
advantage). No function modifies its inputs.

Where this file departs from the papers and from upstream (AgentGym-RL on verl), and why:
1. Multi-turn credit. GAE and REINFORCE++ run over a row's sampled tokens only, in order:
   observation tokens neither receive a return, nor cut or discount the chain, nor supply a
   bootstrap value. verl's REINFORCE++ resets the return at every token outside its mask
   (meant for the padding after EOS): on a multi-turn row, at each observation turn.
2. The outcome reward sits on the row's last *sampled* token (`token_rewards_from_outcome`).
   Upstream put it on the row's last token, an observation, where GAE/REINFORCE++ lost it.
   Both assert that no reward sits on an unsampled token, rather than drop it silently.
3. RLOO: a group of one has no other sample for a baseline (n - 1 = 0): its advantage is 0.
   Upstream refused RLOO at start-up.
4. GRPO keeps upstream's rule for a group of one (mean 0, std 1: its raw score), for parity
   with the paper's runs, although it is not zero-mean; prefer group_size >= 2.
5. `agg_loss` leaves rows without a sampled token out of the sequence means (upstream: 0 / 0).
6. `masked_var` of fewer than two tokens is 0; `masked_whiten` then keeps scale 1, not 1e4.
7. Log-ratios are clamped to [-20, 20] before `exp` in `policy_loss`, k3 and `tis_weights` (as
   verl), so one extreme token cannot overflow to inf and turn the gradients into NaN.
8. Whitening (REINFORCE++, GAE) can be left to the caller (`whiten=False`): under torchrun the
   trainer whitens over every rank's sampled tokens, as one process would.
9. GiGPO (`gigpo_advantages`). (a) The anchor state is a key: by default the user message
   before the turn (`rollout.turn_state_keys`), notes included, so equal texts from different
   true states share an anchor group; a key the env reports replaces it. (b) A turn's reward
   is its change of the trajectory's reward (`Trajectory.turn_rewards`): 0 for a turn without
   an env step and, when an agent retries, minus the discarded attempt's reward on the turn
   that ended it: a row's turn rewards sum to its outcome. (c) Both levels divide by the
   group's std plus GRPO's eps (norm_std=False: mean only); the episode level keeps departure
   4, the step level gives an anchor group of one 0. (d) gamma: --gamma 1, the paper's 0.95.
10. GiGPO's episode mean and std are over a group's trajectories (Eq. 3); verl-agent's default
   takes them over turns (a 1-turn win and a 3-turn loss: +0.5/-0.5 here, +0.75/-0.25 there,
   mean only). episode_stat="step": theirs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far beyond any clip range, still finite in float32
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
INPUTS = ("input_ids", "attention_mask", "position_ids")  # what a forward reads of a row


def _f32(x) -> torch.Tensor:
    """Any tensor-like as float32 (a no-op, not a copy, when it already is)."""
    return torch.as_tensor(x).float()


# ------------------------------------------------------------------------ masked statistics
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """mean(x | mask) = sum(x * m) / sum(m), over all elements or along `dim`. An empty
    selection gives 0, not NaN (the denominator is clamped at 1, exact for 0/1 masks)."""
    x, m = torch.as_tensor(x).float(), torch.as_tensor(mask).float()  # as _f32
    selected = torch.where(m > 0, x, 0.0)  # not x * m: no inf/NaN off the mask leaks in
    if dim is None:
        return selected.sum() / m.sum().clamp(min=1.0)
    return selected.sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements, sum(m (x - mean)^2) / (n - 1), or / n if biased.
    Fewer than two selected elements (one if biased) give 0: the variance is undefined."""
    x, m = _f32(x), _f32(mask)
    sq_dev = torch.where(m > 0, (x - masked_mean(x, m)) ** 2, 0.0).sum()
    denom = m.sum() - 1.0 if unbiased else m.sum()  # n - 1, or n selected
    return torch.where(denom > 0, sq_dev / denom.clamp(min=1.0), 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps), mean and unbiased var over the selected elements, the
    same map on every element (multiply by the mask to zero the rest). shift_mean=False adds
    the mean back. Fewer than two selected elements: scale 1 (departure 6)."""
    x, m = _f32(x), _f32(mask)
    mean, var = masked_mean(x, m), masked_var(x, m)
    scale = torch.where(m.sum() >= 2, torch.rsqrt(var + eps), 1.0)
    out = (x - mean) * scale
    return out if shift_mean else out + mean


# ------------------------------------------------------------------ outcome advantages (B,)
def _finite(scores, name: str = "scores") -> torch.Tensor:
    """The scores as float32, refused where one is NaN or infinite: it would turn its whole
    group (GRPO, RLOO) or batch (whitening) into NaN."""
    s = torch.as_tensor(scores).float()  # as _f32
    if bool(torch.isfinite(s).all()):
        return s
    bad = ~torch.isfinite(s)
    rows, values = torch.nonzero(bad).flatten().tolist()[:5], s[bad][:5].tolist()
    raise ValueError(f"{name} must be finite; rows {rows} hold {values} (an env that returns "
                     "NaN or infinity: env_client refuses such answers as env errors)")


def _group_index(group_ids: torch.Tensor):
    """Group ids (B,) -> (index in 0..n_groups-1 (B,), each row's group size (B,))."""
    _, index, counts = torch.unique(torch.as_tensor(group_ids), return_inverse=True,
                                    return_counts=True)
    return index, counts[index].float()


def _group_mean(scores: torch.Tensor, index: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mean of each row's group (B,), summed in float64: in float32 8 x 0.7 is 5.6000004, so
    a tied group's mean is an ulp off, and that ulp / GRPO's eps an advantage of 0.06."""
    sums = torch.zeros(int(index.max()) + 1, dtype=torch.float64, device=scores.device)
    return (sums.index_add(0, index, scores.double())[index] / n).float()


def grpo_advantages(scores, group_ids, eps=1e-6, norm_std=True) -> torch.Tensor:
    """GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2), outcome supervision:
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps),   g: i's group (G rows), std unbiased.
    norm_std=False only subtracts the mean (Dr. GRPO, Liu et al. 2025). A tied group gets 0; a
    group of one mean 0 and std 1 (departure 4). scores (B,), group_ids (B,) -> (B,)."""
    s = _finite(scores)
    index, n = _group_index(group_ids)
    mean = _group_mean(s, index, n)
    sq_dev = _group_mean((s - mean) ** 2, index, n) * n  # summed over the group
    mean = torch.where(n < 2, 0.0, mean)  # a group of one: its raw score (departure 4)
    std = torch.where(n < 2, 1.0, (sq_dev / (n - 1).clamp(min=1)).sqrt())
    return (s - mean) / (std + eps) if norm_std else s - mean


def rloo_advantages(scores, group_ids) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): baseline = mean of the group's others,
        A_i = s_i - 1/(G-1) sum_{j != i} s_j = G/(G-1) (s_i - mean_g(s)).
    A group of one gets 0 (departure 3). scores (B,) -> (B,)."""
    s = _finite(scores)
    index, n = _group_index(group_ids)
    adv = n / (n - 1).clamp(min=1) * (s - _group_mean(s, index, n))
    return torch.where(n < 2, 0.0, adv)


def token_rewards_from_outcome(rewards, loss_mask: torch.Tensor) -> torch.Tensor:
    """Each outcome reward r_b on row b's last sampled token (departure 2), 0 elsewhere; a row
    without a sampled token gets none. rewards (B,), loss_mask (B, T) -> (B, T) float32."""
    m = torch.as_tensor(loss_mask) > 0  # (B, T)
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).max(dim=1).values  # (B,) last sampled, or -1
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has_token = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_token]
    out[rows, last[has_token]] = _finite(rewards, "rewards").to(m.device)[has_token]
    return out


# -------------------------------------------------------------- per-token advantages (B, T)
def _compact(mask: torch.Tensor):
    """(order (B, W), valid (B, W)): order[b, k] is the position of row b's k-th sampled
    token, valid[b, k] whether it has one; W the most sampled tokens in a row. Gathering with
    `order` squeezes observation tokens out: the backward recursions below never see them."""
    m = torch.as_tensor(mask) > 0
    # A stable sort on "is not sampled": the sampled positions first, in their order
    order = torch.sort((~m).to(torch.uint8), dim=1, stable=True).indices
    counts = m.sum(dim=1)
    width = int(counts.max()) if m.numel() else 0
    valid = torch.arange(width, device=m.device) < counts[:, None]
    return order[:, :width], valid


def _scatter_back(compact: torch.Tensor, order: torch.Tensor, shape) -> torch.Tensor:
    """Undoes `_compact`'s gather: compact[b, k] goes to position order[b, k], 0 elsewhere."""
    return compact.new_zeros(shape).scatter(1, order, compact)  # compact's dtype and device


def _reverse_discounted_cumsum(x: torch.Tensor, factor: float) -> torch.Tensor:
    """y_k = x_k + factor * y_{k+1} along dim 1 of (B, W), y past the end 0. Not the closed
    form (a reversed cumsum of factor^k x_k / factor^k): it underflows for long rows."""
    if factor == 1.0:
        return x.flip(1).cumsum(1).flip(1)
    out = torch.zeros_like(x)
    running = x.new_zeros(x.shape[0])  # (B,)
    for k in reversed(range(x.shape[1])):
        running = x[:, k] + factor * running
        out[:, k] = running
    return out


def _check_rewards_on_sampled(token_rewards: torch.Tensor, m: torch.Tensor) -> None:
    assert not torch.any((token_rewards != 0) & ~m), (
        "a reward sits on an unsampled token (loss_mask 0); it would be lost. Put outcome "
        "rewards on the last sampled token (token_rewards_from_outcome).")


def reinforce_pp_advantages(token_rewards, loss_mask, gamma: float = 1.0,
                            whiten: bool = True) -> torch.Tensor:
    """REINFORCE++ (Hu 2025), over sampled tokens only (departure 1):
        G_t = sum_{k >= t, k sampled} gamma^(#sampled tokens from t to k, exclusive of t) r_k,
        A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8),  over all the batch's sampled tokens.
    0 where loss_mask is 0; whiten=False returns G (departure 8). (B, T) -> (B, T)."""
    r, m = _f32(token_rewards), torch.as_tensor(loss_mask) > 0
    _check_rewards_on_sampled(r, m)
    order, valid = _compact(m)
    returns = _reverse_discounted_cumsum(r.gather(1, order) * valid, gamma)  # (B, W)
    returns = _scatter_back(returns, order, r.shape)  # (B, T)
    return masked_whiten(returns, m) * m if whiten else returns * m


def gae_advantages(token_rewards, values, loss_mask, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True):
    """GAE (Schulman et al. 2016) over each row's sampled tokens in order (departure 1):
        delta_t = r_t + gamma * V(next sampled token after t, 0 after the last) - V_t
        A_t     = delta_t + gamma * lam * A_(next sampled token)
        R_t     = A_t + V_t   (the critic's target, unwhitened)
    A whitened over the batch's sampled tokens unless whiten=False (departure 8); both 0 where
    loss_mask is 0. token_rewards, values, loss_mask (B, T) -> (A, R), each (B, T)."""
    r, v, m = _f32(token_rewards), _f32(values), torch.as_tensor(loss_mask) > 0
    _check_rewards_on_sampled(r, m)
    order, valid = _compact(m)
    r_c = r.gather(1, order) * valid  # (B, W) rewards of the sampled tokens, left-aligned
    v_c = v.gather(1, order) * valid  # (B, W) their values, 0 past the row's last one
    next_v = torch.cat([v_c[:, 1:], torch.zeros_like(v_c[:, :1])], dim=1)  # V(next sampled)
    delta = r_c + gamma * next_v - v_c  # (B, W); 0 on padding, where r, v and next_v are 0
    adv = _scatter_back(_reverse_discounted_cumsum(delta, gamma * lam), order, r.shape)
    returns = (adv + v) * m
    return (masked_whiten(adv, m) if whiten else adv) * m, returns


# ------------------------------------------------------ step-level credit (GiGPO), per turn
def anchor_index(group_ids, state_keys: list[list[str]]) -> torch.Tensor:
    """GiGPO's anchor groups: the turns of one group (any row, any turn index) whose state
    keys (state_keys[b][k]: row b's turn k) are equal, never across groups (another task may
    render the same text) -> (B, K) long, one id per anchor group, -1 past a row's turns."""
    gids = torch.as_tensor(group_ids).tolist()
    if len(gids) != len(state_keys):
        raise ValueError(f"{len(state_keys)} rows of state keys for {len(gids)} group ids")
    K = max((len(keys) for keys in state_keys), default=0)
    out = torch.full((len(gids), K), -1, dtype=torch.long)
    ids: dict = {}
    for b, keys in enumerate(state_keys):
        for k, key in enumerate(keys):
            out[b, k] = ids.setdefault((gids[b], key), len(ids))
    return out


def step_advantages(returns, anchors, eps: float = 1e-6,
                    norm_std: bool = True) -> torch.Tensor:
    """GiGPO's step relative advantage, GRPO's normalisation over anchor groups a:
        A^S_(b,k) = (G_(b,k) - mean_a(G)) / (std_a(G) + eps),   std unbiased.
    An anchor group of one gets 0, as in the paper, not GRPO's raw score (departure 9c).
    returns, anchors (B, K) -> (B, K) float32, 0 where anchors is -1."""
    G, a = _f32(returns), torch.as_tensor(anchors, device=torch.as_tensor(returns).device)
    valid = a >= 0
    out = torch.zeros_like(G)
    if bool(valid.any()):
        g, ids = G[valid], a[valid]
        _, n = _group_index(ids)
        out[valid] = torch.where(n < 2, 0.0, grpo_advantages(g, ids, eps, norm_std))
    return out


def _turn_reward_matrix(scores: torch.Tensor, n_turns: list[int], turn_rewards, K: int):
    """Rewards per turn (B, K), 0 past a row's last; turn_rewards None: the outcome on it."""
    r = torch.zeros((len(n_turns), K), dtype=torch.float32)
    for b, n in enumerate(n_turns):
        if turn_rewards is None:
            if n:
                r[b, n - 1] = scores[b]
        elif len(turn_rewards[b]) != n:
            raise ValueError(f"row {b}: {len(turn_rewards[b])} turn rewards for {n} turns")
        else:
            r[b, :n] = torch.tensor(turn_rewards[b], dtype=torch.float32)
    return _finite(r, "turn_rewards")


def gigpo_advantages(scores, group_ids, loss_mask, turn_ids, state_keys: list[list[str]],
                     turn_rewards: list[list[float]] | None = None, gamma: float = 0.95,
                     step_adv_weight: float = 1.0, eps: float = 1e-6, norm_std: bool = True,
                     episode_stat: str = "trajectory"):
    """GiGPO (Feng et al. 2025): GRPO's episode advantage plus a step one over anchor states,
        A^E_b     = (s_b - mean_g(s)) / (std_g(s) + eps)                  `grpo_advantages`
        G_(b,k)   = sum_{j >= k} gamma^(j-k) r_(b,j)                      return from turn k
        A^S_(b,k) = normalised G_(b,k) within its anchor group            `step_advantages`
        A_(b,t)   = A^E_b + w * A^S_(b, k(t))   on sampled token t of turn k(t), else 0,
    w = step_adv_weight, r_(b,j) row b's turn j's reward (departure 9; turn_rewards None: the
    outcome on the last turn). No repeated state, or w = 0: GRPO. scores, group_ids (B,);
    loss_mask, turn_ids (B, T) (each sampled token's turn, else -1: distributed.build_batch,
    shifted as the mask); state_keys[b][k], turn_rewards[b][k] per turn k of row b -> (B, T)
    float32. episode_stat="step": A^E's mean_g, std_g over turns, not rows (departure 10)."""
    s = _finite(scores)  # first, as every estimator: a NaN score is the error to report
    assert episode_stat in ("trajectory", "step"), (
        f"episode_stat {episode_stat!r}: trajectory|step")
    if turn_ids is None or state_keys is None:
        raise ValueError("gigpo needs turn_ids (distributed.build_batch) and state_keys "
                         "(rollout.turn_state_keys) in AdvantageInputs")
    m, tid = torch.as_tensor(loss_mask) > 0, torch.as_tensor(turn_ids).long()
    if tid.shape != m.shape or bool(((tid >= 0) != m).any()):
        raise ValueError("turn_ids must be >= 0 exactly on the sampled tokens; "
                         "shift them as the mask (turn_ids[:, 1:] with loss_mask[:, 1:])")
    n_turns = (tid.max(dim=1).values + 1).tolist() if tid.shape[1] else [0] * tid.shape[0]
    n_keys = [len(keys) for keys in state_keys]
    if n_turns != n_keys:
        raise ValueError(f"turns per row: {n_turns} in turn_ids, {n_keys} in state_keys")
    s = s.to(tid.device)
    if episode_stat == "trajectory":
        episode = grpo_advantages(s, group_ids, eps, norm_std).to(tid.device)  # (B,)
    else:  # departure 10: over the group's turns, row b counted once per turn (n_b copies)
        turns = torch.tensor(n_turns)  # a row without turns has no copy and no sampled token
        copies = torch.repeat_interleave(torch.arange(len(s)), turns)
        g, s_copies = torch.as_tensor(group_ids).cpu()[copies], s.cpu()[copies]
        per_copy = grpo_advantages(s_copies, g, eps, norm_std) if len(copies) else s.cpu()
        first_copy = (turns.cumsum(0) - turns).clamp(max=max(len(copies) - 1, 0))
        episode = torch.where(turns > 0, per_copy[first_copy], 0.0).to(tid.device)
    anchors = anchor_index(group_ids, state_keys).to(tid.device)  # (B, K)
    r = _turn_reward_matrix(s.cpu(), n_turns, turn_rewards, anchors.shape[1]).to(tid.device)
    step = step_advantages(_reverse_discounted_cumsum(r, gamma), anchors, eps, norm_std)
    # Each turn's step advantage on its sampled tokens; -1 reads column 0, zeroed by the mask
    per_token = (step.gather(1, tid.clamp(min=0)) if step.shape[1]
                 else torch.zeros(m.shape, device=m.device))
    return (episode[:, None] + step_adv_weight * torch.where(m, per_token, 0.0)) * m


# ------------------------------------------------------------------ the estimators, by name
# --algo NAME runs ESTIMATORS[NAME]: inputs -> (advantages, returns or None), each (B, T),
# 0 off the sampled tokens; critic=True: given a critic's values. Unknown names: `estimator`.
@dataclass
class AdvantageInputs:
    scores: torch.Tensor  # (B,) outcome reward of each trajectory
    group_ids: torch.Tensor  # (B,) trajectories with the same id are copies of one task
    mask: torch.Tensor  # (B, T) 1 on sampled tokens (the trainer's shifted loss mask)
    values: torch.Tensor | None = None  # (B, T) V(prefix) per position, for critic=True
    gamma: float = 1.0
    lam: float = 1.0
    # over the batch's sampled tokens; under torchrun the trainer passes one over all ranks
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        lambda x, m: masked_whiten(x, m) * m)
    # GiGPO's step level: turn_ids (B, T); per row, each turn's key and reward
    turn_ids: torch.Tensor | None = None
    state_keys: list[list[str]] | None = None
    turn_rewards: list[list[float]] | None = None
    step_adv_weight: float = 1.0

    @property
    def token_rewards(self) -> torch.Tensor:
        return token_rewards_from_outcome(self.scores, self.mask)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvantageInputs], tuple]
    critic: bool = False  # needs values from a critic, and returns its targets
    grouped: bool = False  # a tied group gets no advantage: dynamic sampling may replace it


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, critic: bool = False, grouped: bool = False):
    """Decorator: --algo `name` is `fn(AdvantageInputs) -> (advantages, returns | None)`."""
    def add(fn):
        ESTIMATORS[name] = Estimator(fn, critic, grouped)
        return fn
    return add


def estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: "
                         f"{', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


@register_estimator("grpo", grouped=True)  # the group-normalised outcome, every sampled token
def _grpo(x: AdvantageInputs):
    return grpo_advantages(x.scores, x.group_ids)[:, None] * x.mask, None


@register_estimator("dr_grpo", grouped=True)  # no std: with --loss-agg seq_mean_token_sum
def _dr_grpo(x: AdvantageInputs):
    return grpo_advantages(x.scores, x.group_ids, norm_std=False)[:, None] * x.mask, None


@register_estimator("rloo", grouped=True)
def _rloo(x: AdvantageInputs):
    return rloo_advantages(x.scores, x.group_ids)[:, None] * x.mask, None


@register_estimator("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs):
    adv = reinforce_pp_advantages(x.token_rewards, x.mask, x.gamma, whiten=False)
    return x.whiten(adv, x.mask), None


@register_estimator("ppo", critic=True)  # GAE with the critic's values; returns its targets
def _gae(x: AdvantageInputs):
    adv, returns = gae_advantages(x.token_rewards, x.values, x.mask, x.gamma, x.lam,
                                  whiten=False)
    return x.whiten(adv, x.mask), returns


@register_estimator("gigpo", grouped=True)
def _gigpo(x: AdvantageInputs):
    return gigpo_advantages(x.scores, x.group_ids, x.mask, x.turn_ids, x.state_keys,
                            x.turn_rewards, x.gamma, x.step_adv_weight), None


# ----------------------------------------------------------------------------------- losses
def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode="seq_mean_token_mean"):
    """A per-token loss (B, T) as a scalar over the sampled tokens; a row without one is in
    no mean (departure 5), a batch without any gives 0 (backward() works):
        token_mean:          sum_{b,t} m l / sum_{b,t} m     (every token weighs the same)
        seq_mean_token_mean: mean_b [ sum_t m l / sum_t m ]  (every row; upstream default)
        seq_mean_token_sum:  mean_b [ sum_t m l ]            (Dr. GRPO, Liu et al. 2025)"""
    assert mode in AGG_MODES, f"unknown loss aggregation {mode!r}: not one of {AGG_MODES}"
    m = torch.as_tensor(loss_mask).float()  # as _f32
    selected = torch.where(m > 0, loss_mat.float(), 0.0)  # not l * m: no inf/NaN off m leaks in
    if mode == "token_mean":
        return selected.sum() / m.sum().clamp(min=1.0)
    per_seq = selected.sum(dim=1)  # (B,)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / m.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / (m.sum(dim=1) > 0).sum().clamp(min=1)


def agg_denominator(loss_mask: torch.Tensor, mode: str = "seq_mean_token_mean") -> float:
    """What `agg_loss` divides by (before its clamp at 1): sampled tokens (token_mean), or
    rows with one. Split into parts (micro-batches, ranks), a batch's loss is
    sum_p agg_loss(p) * d(p) / sum_p d(p), d = agg_denominator (the trainer's weights)."""
    assert mode in AGG_MODES, f"unknown loss aggregation {mode!r}: not one of {AGG_MODES}"
    m = torch.as_tensor(loss_mask).float()  # as _f32
    return float(m.sum() if mode == "token_mean" else (m.sum(dim=-1) > 0).sum())


def policy_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low=0.2, clip_high=0.2,
                dual_clip=None, agg="seq_mean_token_mean", token_weights=None):
    """PPO's clipped surrogate (Schulman et al. 2017) per token, with DAPO's separate ranges:
        rho_t = exp(logp_t - logp_old_t)
        L_t   = -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)
    Dual clip (Ye et al. 2020; dual_clip > 1): for A_t < 0, L_t = min(L_t, -dual_clip * A_t),
    so a huge ratio on a bad action cannot dominate. `token_weights` (B, T) (`tis_weights`)
    multiply L_t before `agg_loss`. logprobs (with grad), old_logprobs, advantages, loss_mask
    (B, T) -> (loss, stats): clip_frac (the share of sampled tokens clipped), approx_kl (k1)."""
    assert dual_clip is None or dual_clip > 1.0, f"dual_clip must be > 1, got {dual_clip}"
    logp, old, adv = logprobs.float(), _f32(old_logprobs), _f32(advantages)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # departure 7
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio  # per-token loss, unclipped
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)  # = -min(...) of the surrogate
    cap = torch.inf if dual_clip is None else -adv * dual_clip  # None: no dual clip
    dual_hit = (adv < 0) & (loss_mat > cap)
    loss_mat = torch.where(dual_hit, cap, loss_mat)
    if token_weights is not None:
        loss_mat = loss_mat * _f32(token_weights)
    loss = agg_loss(loss_mat, loss_mask, agg)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((clipped > unclipped).float(), loss_mask).item(),
                 "approx_kl": masked_mean(old - logp, loss_mask).item()}
    return loss, stats


def value_loss(values, old_values, returns, loss_mask, clip=0.2, agg="seq_mean_token_mean"):
    """Clipped value loss (PPO2's baselines; Ziegler et al. 2019 for LLMs):
        V_clip = V_old + clip(V - V_old, -clip, clip)
        L_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)
    values (with grad), old_values, returns, loss_mask (B, T) -> the loss."""
    v, v_old, ret = values.float(), _f32(old_values), _f32(returns)
    v_clipped = v_old + (v - v_old).clamp(-clip, clip)
    return agg_loss(0.5 * torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2), loss_mask, agg)


def kl_penalty(logprobs, ref_logprobs, kind: str = "k3",
               clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi, (B, T) -> (B, T), with
    d = logp - logp_ref (Schulman 2020, "Approximating KL Divergence"):
        k1 ("kl"):           d                  unbiased, high variance, can be negative
        k2 ("mse"):          0.5 d^2            biased, low variance
        k3 ("low_var_kl"):   exp(-d) + d - 1    unbiased, low variance, >= 0
    As a loss, k1's gradient is grad log pi, zero in expectation under pi: on average it pulls
    nothing toward the reference; k2 and k3 do. k3 is clamped to [-clamp, clamp] (upstream:
    10; None: not) and its log-ratio to +-20 (departure 7). Unmasked (agg_loss masks)."""
    d = logprobs.float() - _f32(ref_logprobs)
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(pi_ref / pi)
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3 if clamp is None else k3.clamp(-clamp, clamp)
    raise ValueError(f"unknown KL estimator {kind!r}: not k1/kl, k2/mse or k3/low_var_kl")


def tis_weights(old_logprobs, sampler_logprobs, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): the tokens were drawn from the
    sampler's kernels (vLLM, bf16), not pi_old, so each token's policy loss is weighted by
        w_t = min(pi_old(y_t) / pi_sampler(y_t), C) = min(exp(logp_old_t - logp_sampler_t), C)
    old_logprobs: the trainer's before the update; sampler_logprobs: the rollout's.
    (B, T) -> (B, T) float32, unmasked."""
    assert cap > 0, f"the TIS cap must be positive, got {cap}"
    log_ratio = _f32(old_logprobs) - _f32(sampler_logprobs)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap).detach()


# ----------------------------------- the sampler's token and log-prob, from logits (B, V)
def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> tuple:
    """A token per row of fp32 logits (B, V) and its log-prob, log softmax(logits / T) before the
    top-p cut (`nucleus`), as `token_logprobs`: where the trainer takes the sampler's numbers,
    the PPO ratio's denominator (train.update). Temperature 0: greedy."""
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
    if temperature <= 0:
        return logp.argmax(-1), logp.max(-1).values
    probs = logp.exp() if top_p >= 1.0 else nucleus(logp.exp(), top_p)
    # drawn on the generator's device (a CPU one with a GPU model: the same stream)
    where = probs.device if generator is None else generator.device
    nxt = torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(probs.device)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's filter: the fewest tokens whose mass reaches top_p (the likeliest always)."""
    sorted_p, idx = probs.sort(-1, descending=True)
    sorted_p = sorted_p * (sorted_p.cumsum(-1) - sorted_p < top_p)
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


# ----------------------------------- log-probs and entropy: from logits (B,T,V), of a model
def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[id] = z_id - logsumexp(z), (B, T, V), (B, T) -> (B, T), in float32: a bf16
    logsumexp is off by ~0.01 nats, showing directly in the importance ratio."""
    z = logits.float()
    return z.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy per token, H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v: stable at any
    scale, no (B, T, V) log p. logits (B, T, V), finite (0 * -inf = NaN) -> (B, T)."""
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


def token_logprobs(model, rows: dict, temperature: float, mask=None, with_entropy=False):
    """log pi(y_t | y_<t) at temperature T of tokens 1..T-1 of `rows` (input_ids,
    attention_mask, position_ids (b, T)) -> (b, T-1), and entropies: the PPO ratio's
    numerator. With `mask` (b, T-1), where head_split_ok, the LM head (b x T x V, a small
    model's largest tensor) runs on the masked positions alone (0 elsewhere)."""
    ids = {k: rows[k] for k in INPUTS}
    targets = rows["input_ids"][:, 1:]
    sel = None if mask is None or not head_split_ok(model) else mask > 0
    if sel is None:
        logits = model(**ids).logits[:, :-1].float()  # (b, T-1, V)
    else:
        head = getattr(model, "masked_logits", None) or partial(masked_logits, model)
        logits = head(sel=sel, **ids).float()  # (n, V); under FSDP, the model's own method
        targets = targets[sel]
    logits = logits / temperature if temperature > 0 else logits
    lp = logprobs_from_logits(logits, targets)
    ent = entropy_from_logits(logits) if with_entropy else None
    if sel is not None:  # scatter back to (b, T-1)
        lp = lp.new_zeros(sel.shape).masked_scatter(sel, lp)
        ent = None if ent is None else ent.new_zeros(sel.shape).masked_scatter(sel, ent)
    return lp, ent


def masked_logits(model, sel=None, **ids) -> torch.Tensor:
    """The LM head on the hidden states of positions 0..T-2 selected by `sel` (b, T-1):
    (n, V), or (b, T-1, V) without it; a forward under FSDP (models.policy.shard_model)."""
    h = model.base_model(**ids).last_hidden_state[:, :-1]
    return model.get_output_embeddings()(h if sel is None else h[sel])


_HEAD_SPLIT = weakref.WeakKeyDictionary()  # model -> head_split_ok


def head_split_ok(model) -> bool:
    """model(x).logits == output_embeddings(base_model(x).last_hidden_state)? Once per model:
    its config may scale or cap logits (Granite, Gemma 2); Llama, Qwen, Mistral do not."""
    if model not in _HEAD_SPLIT:
        _HEAD_SPLIT[model] = _check_head_split(model, next(model.parameters()).dtype)
    return _HEAD_SPLIT[model]


def _check_head_split(model, dtype: torch.dtype) -> bool:
    try:
        with torch.no_grad():
            x = torch.arange(1, 9, device=model.device)[None] % model.config.vocab_size
            full = model(input_ids=x).logits[:, :-1]
            head = getattr(model, "masked_logits", None) or partial(masked_logits, model)
            split = head(input_ids=x)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa
        return bool(torch.allclose(full.float(), split.float(), atol=tol, rtol=tol))
    except Exception:  # no base_model / output embeddings in the usual places
        return False
