"""Pure tensor functions of the RL update: advantage estimators, policy and value losses, KL
estimators, entropy, log-probs and loss aggregation. torch only; nothing here knows about models,
environments or the trainer, so every formula can be tested against numbers worked out by hand.

Shapes (one legend for the whole file):
    B  trajectories in the batch; one row each (a whole multi-turn conversation is one row)
    T  tokens per row (padded)
    G  group size: copies of one task sampled together (GRPO / RLOO groups share a `group_id`)
    V  vocabulary size
`loss_mask` (B, T) is 1 exactly on the tokens the policy sampled (assistant turns) and 0 on prompt,
observation and padding tokens. Masks may be bool, integer or float 0/1. Per-token tensors
(log-probs, values, rewards) are aligned with the token they belong to.

Dtypes: inputs may be float32 or bfloat16; statistics are computed in float32 and every returned
tensor (advantages, returns, losses, log-probs, entropies) is float32, because bf16 keeps about three
significant digits, too few for an importance ratio or a whitened advantage. No function modifies
its inputs.

Where this file departs from the papers and from upstream (AgentGym-RL on verl), and why:
1. Multi-turn credit. GAE and REINFORCE++ run over the sampled tokens of a row only, in order:
   observation tokens neither receive a return, nor cut or discount the chain, nor supply a bootstrap
   value. verl's REINFORCE++ (the library AgentGym-RL trains with) resets the running return at every
   token outside its mask, meant for the padding after EOS; on a multi-turn row that would cut credit
   at each observation turn. (AgentGym-RL's own loss of credit is departure 2's.)
2. The outcome reward sits on the row's last *sampled* token (`token_rewards_from_outcome`). Upstream
   put it on the last token of the row, an observation token, so GAE/REINFORCE++ lost it. The two
   estimators assert that no reward sits on an unsampled token instead of dropping it silently.
3. RLOO: a group of one has no other sample to serve as baseline (the formula divides by n - 1 = 0),
   so its advantage is 0: it adds nothing to the gradient. Upstream refused RLOO at start-up.
4. GRPO keeps upstream's rule for a group of one (mean 0, std 1, i.e. its advantage is its raw score)
   for parity with the paper's runs, although it is not zero-mean; prefer group_size >= 2.
5. `agg_loss`: rows without a sampled token (e.g. dropped trajectories) contribute nothing and are
   left out of the denominator of the sequence means; upstream's per-sequence mean divided 0 by 0.
6. `masked_var` with fewer than two tokens returns 0 and `masked_whiten` then keeps the scale at 1
   rather than multiplying by 1/sqrt(eps) = 1e4.
7. Log-ratios are clamped to [-20, 20] before `exp` in `policy_loss`, in the k3 estimator and in
   `tis_weights` (verl does the same), so one extreme token cannot overflow to inf and turn the
   gradients into NaN.
8. Whitening (REINFORCE++, GAE) can be left to the caller (`whiten=False`): under torchrun the trainer
   whitens with the mean and variance of every rank's sampled tokens, as one process would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far beyond any clip range, still finite in float32
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _f32(x) -> torch.Tensor:
    """Any tensor-like as float32 (a no-op, not a copy, when it already is)."""
    return torch.as_tensor(x).float()


# ------------------------------------------------------------------------------- masked statistics
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """mean(x | mask) = sum(x * m) / sum(m), over all elements or along `dim`.
    An empty selection gives 0, not NaN (the denominator is clamped at 1, exact for 0/1 masks)."""
    x, m = _f32(x), _f32(mask)
    selected = torch.where(m > 0, x, 0.0)  # not x * m: an inf/NaN outside the mask must not leak in
    if dim is None:
        return selected.sum() / m.sum().clamp(min=1.0)
    return selected.sum(dim) / m.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements, sum(m (x - mean)^2) / (n - 1) (or / n when not unbiased).
    Fewer than two selected elements (one when biased) give 0: the variance is undefined there."""
    x, m = _f32(x), _f32(mask)
    n = m.sum()
    sq_dev = torch.where(m > 0, (x - masked_mean(x, m)) ** 2, 0.0).sum()
    denom = n - 1.0 if unbiased else n
    return torch.where(denom > 0, sq_dev / denom.clamp(min=1.0), 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps) with mean and unbiased var taken over the selected elements only.
    shift_mean=False adds the mean back (rescale only). The same affine map is applied to every element,
    selected or not; multiply by the mask to zero the rest. With fewer than two selected elements the
    scale is 1 (departure 6)."""
    x, m = _f32(x), _f32(mask)
    mean, var = masked_mean(x, m), masked_var(x, m)
    scale = torch.where(m.sum() >= 2, torch.rsqrt(var + eps), 1.0)
    out = (x - mean) * scale
    return out if shift_mean else out + mean


# -------------------------------------------------------------------------- outcome advantages (B,)
def _finite(scores, name: str = "scores") -> torch.Tensor:
    """The scores as float32, refused when one is NaN or infinite: one such value would turn every
    advantage of its group (GRPO, RLOO) or the whole batch (whitening) into NaN."""
    s = _f32(scores)
    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()[:5]
        raise ValueError(f"{name} must be finite; rows {rows} hold {s[bad][:5].tolist()} (an env that returns "
                         "NaN or infinity: env_client refuses such step answers as env errors)")
    return s


def _group_index(group_ids: torch.Tensor):
    """Map arbitrary group ids (B,) to 0..n_groups-1; returns (index (B,), group size per row (B,))."""
    _, index, counts = torch.unique(torch.as_tensor(group_ids), return_inverse=True, return_counts=True)
    return index, counts[index].float()


def _group_mean(scores: torch.Tensor, index: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mean of each row's group, broadcast back to the rows (B,). Vectorised with index_add."""
    sums = torch.zeros(int(index.max()) + 1, device=scores.device).index_add(0, index, scores)
    return sums[index] / n


def grpo_advantages(scores, group_ids, eps: float = 1e-6, norm_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2), outcome supervision:
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps),   std unbiased, over the G rows of i's group g.
    norm_std=False only subtracts the mean (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
    Training"). A group of one uses mean 0 and std 1, as upstream (departure 4). A group whose scores
    are all equal gets advantage 0. scores (B,), group_ids (B,) -> (B,)."""
    s = _finite(scores)
    index, n = _group_index(group_ids)
    mean = _group_mean(s, index, n)
    sq_dev = _group_mean((s - mean) ** 2, index, n) * n  # sum over the group of squared deviations
    std = (sq_dev / (n - 1).clamp(min=1)).sqrt()
    single = n < 2
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    return (s - mean) / (std + eps) if norm_std else s - mean


def rloo_advantages(scores, group_ids) -> torch.Tensor:
    """RLOO (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
    2024, "Back to Basics"): each sample's baseline is the mean of the other G - 1 samples of its group,
        A_i = s_i - 1/(G-1) sum_{j != i} s_j = G/(G-1) (s_i - mean_g(s)).
    A group of one has no other sample: its advantage is 0 (departure 3). scores (B,) -> (B,)."""
    s = _finite(scores)
    index, n = _group_index(group_ids)
    adv = n / (n - 1).clamp(min=1) * (s - _group_mean(s, index, n))
    return torch.where(n < 2, 0.0, adv)


def token_rewards_from_outcome(rewards, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each trajectory's outcome reward r_b on its last sampled token (the end of its final
    action), 0 elsewhere: rewards (B,), loss_mask (B, T) -> (B, T) float32. A row with no sampled
    token gets no reward (there is no action to credit); such rows carry no loss either."""
    m = torch.as_tensor(loss_mask) > 0  # (B, T)
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).max(dim=1).values  # (B,) index of the last sampled token, -1 if none
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has_token = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_token]
    out[rows, last[has_token]] = _finite(rewards, "rewards").to(m.device)[has_token]
    return out


# --------------------------------------------------------------------- per-token advantages (B, T)
def _compact(mask: torch.Tensor):
    """Order of the sampled positions of each row, left-aligned: returns (order (B, W), valid (B, W))
    where W is the largest number of sampled tokens in a row, order[b, k] the position of row b's k-th
    sampled token, and valid[b, k] whether row b has a k-th sampled token. Gathering with `order`
    squeezes observation tokens out of a row, so the backward recursions below never see them."""
    m = torch.as_tensor(mask) > 0
    # A stable sort on "is not sampled" keeps the sampled positions first and in their original order.
    order = torch.sort((~m).to(torch.uint8), dim=1, stable=True).indices
    counts = m.sum(dim=1)
    width = int(counts.max()) if m.numel() else 0
    valid = torch.arange(width, device=m.device) < counts[:, None]
    return order[:, :width], valid


def _scatter_back(compact: torch.Tensor, order: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of the gather in `_compact`: put compact[b, k] at position order[b, k], 0 elsewhere."""
    return torch.zeros(shape, dtype=compact.dtype, device=compact.device).scatter(1, order, compact)


def _reverse_discounted_cumsum(x: torch.Tensor, factor: float) -> torch.Tensor:
    """y_k = x_k + factor * y_{k+1}, y past the end = 0, along dim 1 of (B, W). factor 1 (the default
    gamma = lam = 1) is a reversed cumsum; otherwise a loop over W vectorised over B, because the closed
    form (a reversed cumsum of factor^k x_k divided by factor^k) underflows for long rows."""
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
        "a reward sits on an unsampled token (loss_mask 0); it would be lost. Put outcome rewards on "
        "the last sampled token (token_rewards_from_outcome).")


def reinforce_pp_advantages(token_rewards, loss_mask, gamma: float = 1.0, whiten: bool = True) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs"):
        G_t = sum_{k >= t, k sampled} gamma^(#sampled tokens from t to k, exclusive of t) r_k,
        A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8),  mean/var over all sampled tokens of the batch.
    Returns run over sampled tokens only (departure 1); 0 where loss_mask is 0. whiten=False returns G
    unwhitened (departure 8). (B, T) -> (B, T)."""
    r, m = _f32(token_rewards), torch.as_tensor(loss_mask) > 0
    _check_rewards_on_sampled(r, m)
    order, valid = _compact(m)
    returns = _reverse_discounted_cumsum(r.gather(1, order) * valid, gamma)  # (B, W)
    returns = _scatter_back(returns, order, r.shape)  # (B, T)
    return masked_whiten(returns, m) * m if whiten else returns * m


def gae_advantages(token_rewards, values, loss_mask, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True):
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"), over the sampled tokens of each row in order:
        delta_t = r_t + gamma * V(next sampled token after t, 0 after the last) - V_t
        A_t     = delta_t + gamma * lam * A_(next sampled token)
        R_t     = A_t + V_t   (the critic's target, unwhitened)
    Advantages are whitened over all sampled tokens of the batch (as in PPO for LLMs, Ouyang et al.
    2022), unless whiten=False (departure 8); both outputs are 0 where loss_mask is 0, and values there
    are never read (departure 1).
    token_rewards, values, loss_mask (B, T) -> (advantages (B, T), returns (B, T))."""
    r, v, m = _f32(token_rewards), _f32(values), torch.as_tensor(loss_mask) > 0
    _check_rewards_on_sampled(r, m)
    order, valid = _compact(m)
    r_c = r.gather(1, order) * valid  # (B, W) rewards of the sampled tokens, left-aligned
    v_c = v.gather(1, order) * valid  # (B, W) their values; 0 past each row's last sampled token
    next_v = torch.cat([v_c[:, 1:], torch.zeros_like(v_c[:, :1])], dim=1)  # value at the next sampled token
    delta = r_c + gamma * next_v - v_c  # (B, W); 0 on padding, since r, v and next_v are 0 there
    adv = _scatter_back(_reverse_discounted_cumsum(delta, gamma * lam), order, r.shape)  # (B, T)
    returns = (adv + v) * m
    return (masked_whiten(adv, m) if whiten else adv) * m, returns


# ------------------------------------------------------------------- the estimators, by name
# train.py's --algo NAME runs ESTIMATORS[NAME]: one function from AdvantageInputs to (advantages (B, T),
# returns (B, T) or None), 0 off the sampled tokens. An estimator with critic=True gets the critic's values
# and returns the critic's targets; the trainer then trains a critic (PPO). `register_estimator` adds one
# from anywhere, a test file included; an unknown name is refused (`estimator`), never run as another.
@dataclass
class AdvantageInputs:
    scores: torch.Tensor  # (B,) outcome reward of each trajectory
    group_ids: torch.Tensor  # (B,) trajectories with the same id are copies of one task
    mask: torch.Tensor  # (B, T) 1 on sampled tokens (the trainer's shifted loss mask)
    values: torch.Tensor | None = None  # (B, T) V(prefix) per position, for estimators with critic=True
    gamma: float = 1.0
    lam: float = 1.0
    # whitening over every sampled token of the batch; under torchrun the trainer passes one over all ranks
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda x, m: masked_whiten(x, m) * m

    @property
    def token_rewards(self) -> torch.Tensor:
        return token_rewards_from_outcome(self.scores, self.mask)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvantageInputs], tuple]
    critic: bool = False  # needs values from a critic, and returns its targets


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, critic: bool = False):
    """Decorator: make `fn(inputs: AdvantageInputs) -> (advantages (B, T), returns (B, T) | None)` the
    estimator `name` (train.py --algo NAME)."""
    def add(fn):
        ESTIMATORS[name] = Estimator(fn, critic)
        return fn
    return add


def estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


@register_estimator("grpo")
def _grpo(x: AdvantageInputs):
    """GRPO: the group-normalised outcome on every sampled token of the trajectory."""
    return grpo_advantages(x.scores, x.group_ids)[:, None] * x.mask, None


@register_estimator("dr_grpo")
def _dr_grpo(x: AdvantageInputs):
    """Dr. GRPO: GRPO without the division by the group's std (pair with --loss-agg seq_mean_token_sum,
    the paper's other half)."""
    return grpo_advantages(x.scores, x.group_ids, norm_std=False)[:, None] * x.mask, None


@register_estimator("rloo")
def _rloo(x: AdvantageInputs):
    return rloo_advantages(x.scores, x.group_ids)[:, None] * x.mask, None


@register_estimator("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs):
    return x.whiten(reinforce_pp_advantages(x.token_rewards, x.mask, x.gamma, whiten=False), x.mask), None


@register_estimator("ppo", critic=True)
def _gae(x: AdvantageInputs):
    """PPO's: GAE over the sampled tokens with the critic's values; returns are the critic's targets."""
    adv, returns = gae_advantages(x.token_rewards, x.values, x.mask, x.gamma, x.lam, whiten=False)
    return x.whiten(adv, x.mask), returns


# ---------------------------------------------------------------------------------------- losses
def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str = "seq_mean_token_mean"):
    """Reduce a per-token loss (B, T) to a scalar over the sampled tokens:
        token_mean:          sum_{b,t} m l / sum_{b,t} m           (every token weighs the same)
        seq_mean_token_mean: mean_b [ sum_t m l / sum_t m ]        (every trajectory weighs the same;
                             upstream default)
        seq_mean_token_sum:  mean_b [ sum_t m l ]                  (Dr. GRPO, Liu et al. 2025)
    Rows with no sampled token contribute nothing and do not count in the sequence means; if no row
    has a sampled token the loss is 0 (still attached to the graph, so backward() works)."""
    assert mode in AGG_MODES, f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}"
    m = _f32(loss_mask)
    # where() rather than l * m: an inf or NaN at an unsampled position must not leak into the sum.
    masked = torch.where(m > 0, loss_mat.float(), 0.0)  # (B, T)
    if mode == "token_mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    tokens = m.sum(dim=1)  # (B,)
    per_seq = masked.sum(dim=1)  # (B,)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / tokens.clamp(min=1.0)
    return per_seq.sum() / (tokens > 0).sum().clamp(min=1)


def agg_denominator(loss_mask: torch.Tensor, mode: str = "seq_mean_token_mean") -> float:
    """What `agg_loss` divides by (before its clamp at 1): the number of sampled tokens for token_mean,
    the number of rows with a sampled token for the sequence means. A loss over a batch split into parts
    (micro-batches, ranks) is the sum over parts of agg_loss(part) * agg_denominator(part) / (the sum of
    agg_denominator over the parts): what the trainer weights each part's gradient by."""
    assert mode in AGG_MODES, f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}"
    m = _f32(loss_mask)
    return float(m.sum() if mode == "token_mean" else (m.sum(dim=-1) > 0).sum())


def policy_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low: float = 0.2,
                clip_high: float = 0.2, dual_clip: float | None = None, agg: str = "seq_mean_token_mean",
                token_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"), per token:
        rho_t = exp(logp_t - logp_old_t)
        L_t   = -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t)
    with separate low/high ranges ("clip-higher", Yu et al. 2025, "DAPO"). Optional dual clip (Ye et al.
    2020, "Mastering Complex Control in MOBA Games with Deep RL"): for A_t < 0 the loss is capped,
        L_t = min(L_t, -dual_clip * A_t),   dual_clip > 1,
    so a huge ratio on a bad action cannot dominate the batch. `token_weights` (B, T), e.g. truncated
    importance weights (`tis_weights`), multiply L_t before aggregation with `agg_loss`.
    logprobs (with grad), old_logprobs, advantages, loss_mask (B, T) -> (loss, stats); stats holds floats:
    clip_frac (share of sampled tokens where the clipped term binds), dual_clip_frac, approx_kl
    (mean of logp_old - logp over sampled tokens, k1), ratio_mean."""
    assert dual_clip is None or dual_clip > 1.0, f"dual_clip must be > 1, got {dual_clip}"
    logp, old, adv = logprobs.float(), _f32(old_logprobs), _f32(advantages)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # departure 7
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)  # = -min(...) of the surrogate
    dual_hit = torch.zeros_like(loss_mat, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_hit = (adv < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_hit, cap, loss_mat)
    if token_weights is not None:
        loss_mat = loss_mat * _f32(token_weights)
    loss = agg_loss(loss_mat, loss_mask, agg)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), loss_mask).item(),
            "dual_clip_frac": masked_mean(dual_hit.float(), loss_mask).item(),
            "approx_kl": masked_mean(old - logp, loss_mask).item(),
            "ratio_mean": masked_mean(ratio, loss_mask).item(),
        }
    return loss, stats


def value_loss(values, old_values, returns, loss_mask, clip: float = 0.2, agg: str = "seq_mean_token_mean"):
    """Clipped value loss (PPO2 baselines; Schulman et al. 2017; PPO for LLMs in Ziegler et al. 2019):
        V_clip = V_old + clip(V - V_old, -clip, clip)
        L_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)
    values (with grad), old_values, returns, loss_mask (B, T) -> (loss, stats); stats holds floats:
    clip_frac (share of sampled tokens where the clipped term binds), values_mean."""
    v, v_old, ret = values.float(), _f32(old_values), _f32(returns)
    v_clipped = v_old + (v - v_old).clamp(-clip, clip)
    err_unclipped, err_clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
    loss = agg_loss(0.5 * torch.maximum(err_unclipped, err_clipped), loss_mask, agg)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((err_clipped > err_unclipped).float(), loss_mask).item(),
            "values_mean": masked_mean(v, loss_mask).item(),
        }
    return loss, stats


def kl_penalty(logprobs, ref_logprobs, kind: str = "k3", clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL
    Divergence", http://joschu.net/blog/kl-approx.html), with d = logp - logp_ref:
        k1 ("kl"):                d                      unbiased, high variance, can be negative
        k2 ("mse"):               0.5 d^2                biased, low variance
        k3 ("low_var_kl"):        exp(-d) + d - 1        unbiased, low variance, >= 0
    As a loss term (the tokens sampled from pi, their log-probs differentiated), k1's gradient is
    grad log pi, whose expectation under pi is zero: k1 estimates the KL's value but pulls nothing toward
    the reference on average; k2 and k3 do. k3 is clamped to [-clamp, clamp] (upstream: 10) and its
    log-ratio to +-20 before exp (departure 7); clamp=None disables the former. Masking is left to the
    caller (agg_loss). (B, T) -> (B, T)."""
    d = logprobs.float() - _f32(ref_logprobs)
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d**2
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(pi_ref / pi)
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3 if clamp is None else k3.clamp(-clamp, clamp)
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1/kl, k2/mse or k3/low_var_kl")


def tis_weights(old_logprobs, sampler_logprobs, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): the sampler (e.g. vLLM, bf16 kernels) and the trainer assign different
    probabilities to the same tokens, so the tokens were drawn from pi_sampler, not pi_old. Each token's
    policy loss is reweighted by the truncated ratio
        w_t = min(pi_old(y_t) / pi_sampler(y_t), C) = min(exp(logp_old_t - logp_sampler_t), C),
    a constant (no gradient). old_logprobs: the trainer's log-probs before the update (the PPO ratio's
    denominator); sampler_logprobs: the rollout's. (B, T) -> (B, T) float32; masking is left to the caller."""
    assert cap > 0, f"the TIS cap must be positive, got {cap}"
    log_ratio = (_f32(old_logprobs) - _f32(sampler_logprobs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap).detach()


# ------------------------------------------------------------------------------ from logits (B,T,V)
def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[id] = z_id - logsumexp(z): logits (B, T, V), ids (B, T) -> (B, T) float32.
    The gather comes first, so no (B, T, V) log-softmax is materialised. bf16 logits are upcast to
    float32 (one float32 copy of the logits) because a bf16 logsumexp is off by ~0.01 nats, which
    shows up directly in the importance ratio; chunk over rows before calling to bound that copy."""
    z = logits.float()
    return z.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per token: H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v,
    since log p_v = z_v - logsumexp(z). Stable for any logits scale (softmax and logsumexp subtract the
    max). logits (B, T, V) -> (B, T) float32; needs softmax(z) and the product p * z as (B, T, V)
    temporaries, and none of log p. Logits must be finite (a -inf logit would give 0 * -inf = NaN)."""
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
