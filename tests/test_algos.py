"""algos.py against numbers worked out by hand and against naive per-token Python loops."""

import math
import random
import statistics

import pytest
import torch

import algos
import train
from test_cli import one_line_refusal

T_ = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32),
                          torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=tol)


# -------------------------------------------------------------------------------- masked statistics
def test_masked_stats_by_hand():
    x, m = T_([1.0, 2.0, 3.0, 100.0]), T_([1, 1, 1, 0])
    assert close(algos.masked_mean(x, m), 2.0)  # (1+2+3)/3
    assert close(algos.masked_var(x, m), 1.0)  # (1+0+1)/(3-1)
    assert close(algos.masked_var(x, m, unbiased=False), 2 / 3)
    # (x - 2) / 1 on every element, the unselected 100 included (same affine map)
    assert close(algos.masked_whiten(x, m), [-1.0, 0.0, 1.0, 98.0])
    assert close(algos.masked_whiten(x, m, shift_mean=False), [1.0, 2.0, 3.0, 100.0])


def test_masked_stats_empty_and_single():
    x = T_([[1.0, 2.0], [3.0, 4.0]])
    # empty row: 0, no NaN
    assert close(algos.masked_mean(x, T_([[1, 1], [0, 0]]), dim=1), [1.5, 0.0])
    assert close(algos.masked_mean(x, torch.zeros(2, 2)), 0.0)
    one = T_([[0, 1], [0, 0]])
    assert close(algos.masked_var(x, one), 0.0)
    assert close(algos.masked_whiten(x, one)[0, 1], 0.0)  # x - mean = 0, scale 1
    assert close(algos.masked_whiten(x, one, shift_mean=False), x)  # not x / sqrt(eps)


# --------------------------------------------------------------------------- GRPO / RLOO advantages
def test_grpo_by_hand():
    # group 0: [1,0,0,1] mean 0.5, unbiased std sqrt(4*0.25/3) = 0.57735
    # -> +-0.5/0.57735 = +-0.866025
    # group 7 (one member): mean 0, std 1 -> 5 / (1 + 1e-6); group 3 all equal -> 0
    scores = T_([1.0, 2.0, 0.0, 5.0, 0.0, 2.0, 1.0])
    groups = T_([0, 3, 0, 7, 0, 3, 0])
    a = algos.grpo_advantages(scores, groups)
    z = 0.5 / math.sqrt(1 / 3)
    assert close(a, [z, 0.0, -z, 5.0 / (1 + 1e-6), -z, 0.0, z], tol=1e-5)
    assert close(algos.grpo_advantages(scores, groups, norm_std=False),
                 [0.5, 0, -0.5, 5.0, -0.5, 0, 0.5])
    assert a.dtype == torch.float32


def test_grpo_all_equal_and_singletons_no_nan():
    a = algos.grpo_advantages(torch.ones(8), torch.arange(8) // 4)
    assert torch.equal(a, torch.zeros(8))
    a = algos.grpo_advantages(T_([0.0, 1.0, 3.0]), T_([0, 1, 2]))  # every group of one
    assert close(a, T_([0.0, 1.0, 3.0]) / (1 + 1e-6))


def test_rloo_by_hand():
    # group [1,0,0,1]: A_0 = 1 - mean(0,0,1) = 2/3 = 4/3 * (1 - 0.5); singleton -> 0; all equal -> 0
    scores = T_([1.0, 0.0, 0.0, 1.0, 7.0, 3.0, 3.0])
    groups = [5, 5, 5, 5, 9, 2, 2]
    a = algos.rloo_advantages(scores, groups)
    assert close(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])
    # parity with the literal leave-one-out definition on random groups
    s = torch.rand(12)
    g = torch.arange(12) // 3
    naive = [s[i] - statistics.mean(float(s[j]) for j in range(12) if g[j] == g[i] and j != i)
             for i in range(12)]
    assert close(algos.rloo_advantages(s, g), naive)


# ---------------------------------------------------------------------------------- outcome rewards
def test_token_rewards_from_outcome():
    mask = T_([[0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    out = algos.token_rewards_from_outcome(T_([1.0, 2.0, 3.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 0] = 1.0, 2.0  # last sampled token; the empty row gets nothing
    assert torch.equal(out, expected)


# ------------------------------------------------------------------ REINFORCE++ and GAE over masks
def naive_returns(r, m, gamma):
    """Per-row loop: discount only across sampled tokens; observation tokens are skipped."""
    out, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        if m[t]:
            running = r[t] + gamma * running
            out[t] = running
    return out


def naive_gae(r, v, m, gamma, lam):
    adv, last_adv, next_v = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        if m[t]:
            delta = r[t] + gamma * next_v - v[t]
            last_adv = delta + gamma * lam * last_adv
            adv[t], next_v = last_adv, v[t]
    return adv


def naive_whiten(rows, masks):
    flat = [x for row, m in zip(rows, masks) for x, k in zip(row, m) if k]
    mu, sd = statistics.mean(flat), statistics.stdev(flat)
    scale = math.sqrt(sd**2 + 1e-8)
    return [[(x - mu) / scale if k else 0.0 for x, k in zip(row, m)] for row, m in zip(rows, masks)]


def random_batch(seed, B=7, T=13):
    """Multi-turn masks with holes, the outcome reward on the last sampled token, some per-turn
    rewards on other sampled tokens, one row with no sampled token, and values everywhere (obs ones
    are junk)."""
    g = random.Random(seed)
    masks = [[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [0] * T]
    while len(masks) < B:
        masks.append([int(g.random() < 0.5) for _ in range(T)])
    rewards = [[0.0] * T for _ in range(B)]
    for b, m in enumerate(masks):
        sampled = [t for t in range(T) if m[t]]
        if sampled:
            rewards[b][sampled[-1]] = g.choice([0.0, 1.0, 0.3])
            if len(sampled) > 2:
                rewards[b][sampled[0]] = g.uniform(-0.5, 0.5)
    values = [[g.uniform(-1, 1) if m[t] else 100.0 for t in range(T)] for m in masks]
    return T_(rewards), T_(values), T_(masks), rewards, values, masks


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_matches_naive_loop(gamma, seed):
    r, _, m, rows_r, _, rows_m = random_batch(seed)
    got = algos.reinforce_pp_advantages(r, m, gamma)
    expected = naive_whiten([naive_returns(x, k, gamma) for x, k in zip(rows_r, rows_m)], rows_m)
    assert close(got, expected, tol=1e-4)
    assert not torch.isnan(got).any() and torch.equal(got[1], torch.zeros(13))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.8, 0.0)])
@pytest.mark.parametrize("seed", [0, 3])
def test_gae_matches_naive_loop(gamma, lam, seed):
    r, v, m, rows_r, rows_v, rows_m = random_batch(seed)
    adv, ret = algos.gae_advantages(r, v, m, gamma, lam)
    raw = [naive_gae(x, y, k, gamma, lam) for x, y, k in zip(rows_r, rows_v, rows_m)]
    assert close(adv, naive_whiten(raw, rows_m), tol=1e-4)
    expected_ret = [[a + y if k else 0.0 for a, y, k in zip(*row)]
                    for row in zip(raw, rows_v, rows_m)]
    assert close(ret, expected_ret, tol=1e-5)


def test_reinforce_pp_by_hand():
    # sampled at 1, 2, 4; reward 1 at 4; gamma 0.5 discounts per sampled token, the obs token 3 is
    # skipped: returns 0.25, 0.5, 1.0 -> whitened over the three tokens
    m = T_([[0, 1, 1, 0, 1]])
    r = algos.token_rewards_from_outcome(T_([1.0]), m)
    rets = [0.25, 0.5, 1.0]
    mu, sd = statistics.mean(rets), statistics.stdev(rets)
    a1, a2, a4 = [(x - mu) / sd for x in rets]
    assert close(algos.reinforce_pp_advantages(r, m, 0.5), [[0, a1, a2, 0, a4]], tol=1e-4)


def test_gae_by_hand():
    # sampled at 0 and 2; the obs token's value 9.0 must not be read. gamma 0.9, lam 0.5:
    # t=2: delta = 1 + 0 - 0.8 = 0.2, A = 0.2;
    # t=0: delta = 0 + 0.9*0.8 - 0.5 = 0.22, A = 0.22 + 0.45*0.2 = 0.31
    # returns 0.81, 0, 1.0; whitened A of two values: +-1/sqrt(2)
    adv, ret = algos.gae_advantages(T_([[0.0, 0.0, 1.0]]), T_([[0.5, 9.0, 0.8]]),
                                    T_([[1, 0, 1]]), 0.9, 0.5)
    assert close(ret, [[0.81, 0.0, 1.0]])
    assert close(adv, [[1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)]], tol=1e-4)


def test_reward_on_observation_token_is_refused():
    with pytest.raises(AssertionError, match="unsampled"):
        algos.reinforce_pp_advantages(T_([[0.0, 1.0]]), T_([[1, 0]]))
    with pytest.raises(AssertionError, match="unsampled"):
        algos.gae_advantages(T_([[0.0, 1.0]]), torch.zeros(1, 2), T_([[1, 0]]))


def test_advantages_no_sampled_tokens_at_all():
    z = torch.zeros(2, 4)
    assert torch.equal(algos.reinforce_pp_advantages(z, z), z)
    adv, ret = algos.gae_advantages(z, torch.ones(2, 4), z)
    assert torch.equal(adv, z) and torch.equal(ret, z)


def test_unwhitened_advantages_whiten_to_the_default():
    """whiten=False leaves whitening to the caller (the trainer whitens over every rank's
    tokens)."""
    r, v, m, *_ = random_batch(1)
    raw = algos.reinforce_pp_advantages(r, m, 0.9, whiten=False)
    assert close(algos.masked_whiten(raw, m) * m, algos.reinforce_pp_advantages(r, m, 0.9))
    adv, ret = algos.gae_advantages(r, v, m, 0.99, 0.95, whiten=False)
    adv_w, ret_w = algos.gae_advantages(r, v, m, 0.99, 0.95)
    assert close(algos.masked_whiten(adv, m) * m, adv_w) and torch.equal(ret, ret_w)
    assert torch.equal(adv, adv * m)  # still 0 off the mask


def test_the_reinforce_pp_estimator_whitens_its_returns():
    """--algo reinforce_pp as the trainer runs it (algos.estimator, whiten=False inside, then the
    inputs' `whiten`, which under torchrun spans every rank): the advantages are the returns
    whitened over the batch's sampled tokens, not the raw returns. By hand: sampled at 1, 2, 4,
    reward 1 at 4, gamma 0.5: returns 0.25, 0.5, 1.0 (mean 7/12, unbiased std 0.381881)."""
    m = T_([[0, 1, 1, 0, 1]])
    x = algos.AdvantageInputs(T_([1.0]), T_([0]), m, gamma=0.5)
    adv, returns = algos.estimator("reinforce_pp").fn(x)
    assert returns is None  # no critic to train
    assert close(adv, [[0.0, -0.872872, -0.218218, 0.0, 1.091089]], tol=1e-4)
    # the whitening is the one the inputs carry, given the raw returns
    x.whiten = lambda v, mask: 10 * v * mask
    adv, _ = algos.estimator("reinforce_pp").fn(x)
    assert close(adv, [[0.0, 2.5, 5.0, 0.0, 10.0]])


# ------------------------------------------------------------------------------------------ losses
def test_agg_loss_modes_with_empty_row():
    loss = T_([[1.0, 2.0, 3.0], [4.0, 0.0, float("nan")], [9.0, 9.0, 9.0]])
    mask = T_([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert close(algos.agg_loss(loss, mask, "token_mean"), 7 / 3)  # (1+2+4)/3
    # (1.5 + 4)/2, empty row left out
    assert close(algos.agg_loss(loss, mask, "seq_mean_token_mean"), 2.75)
    assert close(algos.agg_loss(loss, mask, "seq_mean_token_sum"), 3.5)  # (3 + 4)/2
    leaf = torch.ones(2, 3, requires_grad=True)
    for mode in algos.AGG_MODES:
        out = algos.agg_loss(leaf * 5, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and not torch.isnan(leaf.grad).any()
    with pytest.raises(AssertionError):
        algos.agg_loss(loss, mask, "seq-mean")


def test_agg_denominator_is_what_agg_loss_divides_by():
    mask = T_([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert algos.agg_denominator(mask, "token_mean") == 3.0
    assert algos.agg_denominator(mask, "seq_mean_token_mean") == 2.0  # the empty row does not count
    assert algos.agg_denominator(mask, "seq_mean_token_sum") == 2.0
    assert algos.agg_denominator(torch.zeros(0, 3), "token_mean") == 0.0
    # a batch cut in two parts: the loss is the denominator-weighted mean of the parts' losses
    g = torch.Generator().manual_seed(0)
    loss, m = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) < 0.6).float()
    for mode in algos.AGG_MODES:
        parts = [(loss[:2], m[:2]), (loss[2:], m[2:])]
        dens = [algos.agg_denominator(pm, mode) for _, pm in parts]
        mixed = sum(d * algos.agg_loss(pl, pm, mode)
                    for (pl, pm), d in zip(parts, dens)) / sum(dens)
        assert close(mixed, algos.agg_loss(loss, m, mode)), mode


def _pg_inputs():
    # ratios 1.5, 0.5, 0.5, 3.0 against advantages +1, -1, +1, -1
    old = torch.zeros(1, 4)
    logp = torch.log(T_([[1.5, 0.5, 0.5, 3.0]])).requires_grad_()
    return logp, old, T_([[1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4)


def test_policy_loss_clipping_by_hand():
    logp, old, adv, m = _pg_inputs()
    # per token: -min(1.5, 1.2)=-1.2 (clipped); -min(-0.5,-0.8)=0.8 (clipped); -min(0.5,0.8)=-0.5;
    # -min(-3,-1.2)=3
    loss, stats = algos.policy_loss(logp, old, adv, m, agg="token_mean")
    assert close(loss, (-1.2 + 0.8 - 0.5 + 3.0) / 4)
    assert stats["clip_frac"] == 0.5 and set(stats) == {"clip_frac", "approx_kl"}
    assert close(stats["approx_kl"], -(math.log(1.5) + 2 * math.log(0.5) + math.log(3.0)) / 4)
    loss.backward()  # d/dlogp of -A*ratio/4 where unclipped, 0 where the clip binds
    assert close(logp.grad, [[0.0, 0.0, -0.5 / 4, 3.0 / 4]])


def test_policy_loss_asymmetric_and_dual_clip():
    logp, old, adv, m = _pg_inputs()
    loss, _ = algos.policy_loss(logp, old, adv, m, clip_low=0.1, clip_high=0.3, agg="token_mean")
    assert close(loss, (-1.3 + 0.9 - 0.5 + 3.0) / 4)  # ratio clipped to [0.9, 1.3]
    # dual clip 2: token 4 (A=-1, loss 3) is capped at -2 * A = 2, with zero gradient
    loss, stats = algos.policy_loss(logp, old, adv, m, dual_clip=2.0, agg="token_mean")
    assert close(loss, (-1.2 + 0.8 - 0.5 + 2.0) / 4) and stats["clip_frac"] == 0.5
    loss.backward()
    assert close(logp.grad, [[0.0, 0.0, -0.5 / 4, 0.0]])
    with pytest.raises(AssertionError):
        algos.policy_loss(logp, old, adv, m, dual_clip=0.5)


def test_policy_loss_extreme_ratio_stays_finite():
    logp = T_([[200.0, 0.0]], requires_grad=True)
    loss, _ = algos.policy_loss(logp, torch.zeros(1, 2), T_([[1.0, -1.0]]), torch.ones(1, 2),
                                dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_tis_weights_by_hand():
    # trainer 0.5 vs sampler 0.25 -> ratio 2, capped at 1.5; 0.25 vs 0.5 -> 0.5; equal -> 1;
    # extreme -> cap
    old, sampler = torch.log(T_([0.5, 0.25, 0.3, 1.0])), torch.log(T_([0.25, 0.5, 0.3, 1e-30]))
    w = algos.tis_weights(old, sampler, 1.5)
    assert close(w, [1.5, 0.5, 1.0, 1.5]) and not w.requires_grad
    assert close(algos.tis_weights(old, sampler, 10.0)[:3], [2.0, 0.5, 1.0])
    with pytest.raises(AssertionError):
        algos.tis_weights(old, sampler, 0.0)


def test_policy_loss_token_weights():
    """Each token's clipped loss (and its gradient) is multiplied by its weight before
    aggregation."""
    logp, old, adv, m = _pg_inputs()
    w = T_([[2.0, 1.0, 0.5, 0.0]])
    loss, _ = algos.policy_loss(logp, old, adv, m, agg="token_mean", token_weights=w)
    # per-token losses as in the clipping test
    assert close(loss, (-1.2 * 2 + 0.8 - 0.5 * 0.5 + 0.0) / 4)
    loss.backward()
    assert close(logp.grad, [[0.0, 0.0, -0.5 * 0.5 / 4, 0.0]])
    plain, _ = algos.policy_loss(logp.detach(), old, adv, m, agg="seq_mean_token_mean",
                                 token_weights=torch.ones(1, 4))
    assert close(plain, algos.policy_loss(logp.detach(), old, adv, m)[0])


def test_value_loss_by_hand():
    # token 1: V_clip = 0.5 + 0.2 = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845 (clipped binds)
    # token 2: V_clip = 1.0 (inside the range); both errors 1 -> 0.5
    v = T_([[1.0, 1.0]], requires_grad=True)
    loss = algos.value_loss(v, T_([[0.5, 0.9]]), T_([[2.0, 0.0]]), torch.ones(1, 2), clip=0.2,
                            agg="token_mean")
    assert close(loss, (0.845 + 0.5) / 2)
    loss.backward()
    # clipped term is constant in V; the other: (V - R) / 2 tokens
    assert close(v.grad, [[0.0, 0.5]])


def test_kl_estimators_by_hand():
    logp, ref = torch.log(T_([0.5])), torch.log(T_([0.25]))  # d = log 2
    d = math.log(2)
    assert close(algos.kl_penalty(logp, ref, "k1"), d)
    assert close(algos.kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    assert close(algos.kl_penalty(logp, ref, "k3"), 0.5 + d - 1)  # pi_ref/pi - log(pi_ref/pi) - 1
    for alias, name in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        assert torch.equal(algos.kl_penalty(logp, ref, alias), algos.kl_penalty(logp, ref, name))
    with pytest.raises(ValueError):
        algos.kl_penalty(logp, ref, "k4")


def test_k3_clamp_and_finite_gradient():
    logp = T_([0.0, 0.0, 0.0], requires_grad=True)
    ref = T_([-30.0, 30.0, -1.0])
    k3 = algos.kl_penalty(logp, ref)
    assert close(k3, [10.0, 10.0, math.exp(-1) + 1 - 1])
    # clamp=None: no cap on k3 (d = 15 -> e^-15 + 15 - 1); the log-ratio itself is still held
    # to +-20
    assert close(algos.kl_penalty(T_([0.0]), T_([-15.0]), clamp=None), [math.exp(-15) + 14],
                 tol=1e-5)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


# ----------------------------------------------------------------------------------- from logits
def test_entropy_uniform_and_naive():
    assert close(algos.entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    z = torch.randn(3, 5, 11) * 4
    p = torch.softmax(z.double(), -1)
    assert close(algos.entropy_from_logits(z), -(p * p.log()).sum(-1), tol=1e-4)
    peaked = algos.entropy_from_logits(T_([[[1000.0, 0.0, -1000.0]]]))  # no overflow, no NaN
    assert close(peaked, [[0.0]])


def test_logprobs_from_logits():
    z, ids = torch.randn(2, 4, 9), torch.randint(0, 9, (2, 4))
    expected = torch.log_softmax(z.double(), -1).gather(-1, ids[..., None])[..., 0]
    assert close(algos.logprobs_from_logits(z, ids), expected)
    assert close(algos.logprobs_from_logits(T_([[[1e4, 0.0]]]), T_([[1]])), [[-1e4]])


# -------------------------------------------------------------------------------- dtypes, purity
def test_bf16_inputs_compute_in_float32():
    r, v, m, *_ = random_batch(5)
    adv_bf, ret_bf = algos.gae_advantages(r.bfloat16(), v.bfloat16(), m)
    adv, ret = algos.gae_advantages(r.bfloat16().float(), v.bfloat16().float(), m)
    assert (adv_bf.dtype == torch.float32 and torch.allclose(adv_bf, adv)
            and torch.allclose(ret_bf, ret))
    assert algos.reinforce_pp_advantages(r.bfloat16(), m).dtype == torch.float32
    assert algos.grpo_advantages(T_([1.0, 0.0]).bfloat16(), T_([0, 0])).dtype == torch.float32
    logp = torch.randn(2, 5).bfloat16().requires_grad_()
    loss, _ = algos.policy_loss(logp, logp.detach() + 0.01, torch.randn(2, 5), torch.ones(2, 5))
    loss.backward()
    assert loss.dtype == torch.float32 and logp.grad.dtype == torch.bfloat16
    z, ids = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    lp = algos.logprobs_from_logits(z.bfloat16(), ids)
    assert (lp.dtype == torch.float32
            and close(lp, algos.logprobs_from_logits(z.bfloat16().float(), ids)))
    assert algos.entropy_from_logits(z.bfloat16()).dtype == torch.float32
    assert algos.kl_penalty(logp, logp.detach()).dtype == torch.float32


def test_inputs_not_modified():
    r, v, m, *_ = random_batch(7)
    copies = [r.clone(), v.clone(), m.clone()]
    algos.gae_advantages(r, v, m, 0.9, 0.9)
    algos.reinforce_pp_advantages(r, m, 0.9)
    algos.masked_whiten(v, m)
    algos.agg_loss(v, m, "token_mean")
    assert all(torch.equal(a, b) for a, b in zip([r, v, m], copies))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_are_refused_not_spread(bad):
    """One NaN would make every GRPO advantage of its group NaN (and every token of a whitened
    batch)."""
    scores, groups = torch.tensor([1.0, bad, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])
    for fn in (algos.grpo_advantages, algos.rloo_advantages):
        with pytest.raises(ValueError, match=r"scores must be finite; rows \[1\]"):
            fn(scores, groups)
    with pytest.raises(ValueError, match="rewards must be finite"):
        algos.token_rewards_from_outcome(scores, torch.ones(4, 3))
    x = algos.AdvantageInputs(scores, groups, torch.ones(4, 3), torch.zeros(4, 3))
    for name in algos.ESTIMATORS:
        with pytest.raises(ValueError, match="must be finite"):
            algos.estimator(name).fn(x)


def test_an_estimator_is_grouped_exactly_when_a_tied_group_gets_no_advantage():
    """Dynamic sampling replaces tied groups, so trainer/config.py keeps it to `grouped`
    estimators. A group all 1 and one all 0 (two turns, reward at the end): GRPO, RLOO and GiGPO
    give them nothing; REINFORCE++'s whitened batch and PPO's critic do."""
    scores, groups = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])
    tid = torch.tensor([[-1, 0, 0, -1, 1]] * 4)  # the turn of each token; -1: not sampled
    x = algos.AdvantageInputs(scores, groups, (tid >= 0).float(), torch.zeros(4, 5),
                              turn_ids=tid, state_keys=[["start", "mid"]] * 4,
                              turn_rewards=[[0.0, float(s)] for s in scores])
    for name in ("grpo", "dr_grpo", "rloo", "gigpo", "reinforce_pp", "ppo"):
        adv, _ = algos.estimator(name).fn(x)
        assert bool((adv == 0).all()) == algos.estimator(name).grouped, name


def test_dynamic_sampling_keeps_to_group_relative_estimators(model_folder, capsys):
    """A tied group carries signal where the baseline is not the group's (REINFORCE++'s whitened
    batch, PPO's critic): --dynamic-sampling is refused there in one line, and --model's
    default leaves it off."""
    for algo in ("reinforce_pp", "ppo"):
        one_line_refusal(["--env", "corridor", "--algo", algo, "--dynamic-sampling"],
                         f"--dynamic-sampling with --algo {algo}: its advantages are not "
                         "relative to the group", capsys)
    for algo, on in (("ppo", False), ("reinforce_pp", False), ("grpo", True), ("gigpo", True)):
        cfg = train.parse_args(["--env", "corridor", "--model", str(model_folder), "--algo",
                                algo])
        assert cfg.dynamic_sampling is on, algo


def test_a_tied_group_of_any_score_gets_exactly_zero():
    """In float32 8 x 0.7 sums to 5.6000004: a mean an ulp off the scores, which over GRPO's eps
    was an advantage of 0.06 on a group that carries no signal (any env with scores other than
    0 and 1: BabyAI, SciWorld)."""
    for score in (0.1, 0.35, 0.7, 0.9):
        for G in (3, 6, 8, 16):
            s, g = torch.full((G,), score), torch.zeros(G, dtype=torch.long)
            assert algos.grpo_advantages(s, g).abs().max() == 0, (score, G)
            assert algos.rloo_advantages(s, g).abs().max() == 0, (score, G)
    a = algos.grpo_advantages(torch.tensor([0.7, 0.7, 0.1, 0.1]), torch.tensor([0, 0, 1, 1]))
    assert (a == 0).all()
