"""One update of the policy (and critic) on a step's trajectories: advantages by the --algo estimator,
then `ppo_epochs` passes of clipped policy-gradient steps over mini-batches, micro-batched by length,
then how far the update moved the policy (update_kl).

`run` is train.py's Run (cfg, model: the fp32 master weights, prec: policy.Precision whose model
computes, ref, critic, optims, pad, device); anything with those attributes will do (the tests and
bench/replay_step.py build a small namespace). Under torchrun every rank brings its own whole groups and
the update equals the one a single process would make on all of them (micro_weight, distributed.py).
"""

from __future__ import annotations

import torch

import algos
from distributed import all_max, all_sum, global_whiten, world_size
from policy import token_logprobs
from rollout import Trajectory, build_batch, length_buckets


def advantages(run, batch: dict, mask: torch.Tensor, passes) -> tuple:
    """(advantages, returns, values), each (B, T-1) on sampled tokens, by the --algo estimator. Whitening
    uses every rank's tokens (global_whiten), as one process holding all trajectories would."""
    est = algos.estimator(run.cfg.algo)
    values = None
    if est.critic:  # V of the prefix that produced token t+1
        values = passes(lambda idx: run.critic(**rows_of(batch, idx))[:, :-1])
    x = algos.AdvantageInputs(batch["rewards"], batch["group_ids"], mask, values, run.cfg.gamma, run.cfg.lam,
                              whiten=global_whiten)
    adv, returns = est.fn(x)
    return adv, returns, values


def rows_of(batch: dict, idx: list[int]) -> dict:
    return {k: batch[k][idx] for k in ("input_ids", "attention_mask", "position_ids")}


def micro_weight(mask_micro: torch.Tensor, denominator: float, mode: str, world: int = 1) -> float:
    """The factor w = world * agg_denominator(micro) / denominator on a micro-batch's loss before
    backward, `denominator` being agg_denominator of the whole mini-batch on all ranks: the accumulated
    gradients are then those of the mini-batch's loss, in every aggregation mode (the factor `world`
    undoes FSDP's averaging over ranks: sum_ranks sum_micro w/world * loss_micro = the global loss)."""
    return world * algos.agg_denominator(mask_micro, mode) / max(denominator, 1.0)


def update(run, trajs: list[Trajectory]) -> dict:
    """Advantages, then `ppo_epochs` passes of clipped policy-gradient steps over mini-batches,
    micro-batched by length. Under torchrun each rank brings its own trajectories (whole groups) and the
    update is the one a single process would make on all of them: each micro-batch's loss is weighted by
    its share of the global loss (micro_weight). FSDP's forward and backward are collectives, so every
    rank runs as many passes as the busiest one, the extra ones on a blank row without sampled tokens
    (weight 0); a rank may bring no trajectory at all."""
    cfg, world, B = run.cfg, world_size(), len(trajs)
    blank = [Trajectory("", -1, -1, [], [run.pad, run.pad], [0, 0], [0.0, 0.0])] if world > 1 else []
    batch = {k: v.to(run.device) for k, v in build_batch(list(trajs) + blank, run.pad).items()}
    # Token t+1's mask and sampler log-prob sit at t, where the logits that produced it are: (B, T-1)
    mask, sampler_lp = batch["loss_mask"][:, 1:], batch["old_logprobs"][:, 1:]
    lengths = batch["attention_mask"].sum(-1).tolist()

    def in_step(buckets: list[list[int]]) -> list[list[int]]:  # as many passes as the busiest rank
        return buckets + [[B]] * (all_max(len(buckets)) - len(buckets))

    def passes(fn, skip=frozenset()) -> torch.Tensor:  # fn(row indices) -> (b, T-1), by length buckets
        out = torch.zeros_like(mask)
        rows = [i for i in range(B) if i not in skip]
        with torch.no_grad():
            for idx in in_step([[rows[j] for j in b] for b in length_buckets([lengths[i] for i in rows],
                                                                             cfg.micro_batch_tokens)]):
                out[idx] = fn(idx)
        return out

    adv, returns, values = advantages(run, batch, mask, passes)
    idle = idle_rows(run, adv, mask, B)
    ref_lp = None
    if run.ref is not None:
        ref_lp = passes(lambda idx: token_logprobs(run.ref, rows_of(batch, idx), cfg.temperature, mask=mask[idx])[0])
    # The PPO ratio's denominator: the sampler's log-probs when the sampler is this very model computing
    # in fp32 (HF generate), else (vLLM, bf16, or with --tis-cap) the trainer's own, recomputed before
    # the update: in bf16 a cached decode and a whole-row forward round differently (|diff| 0.04 per token
    # on SmolLM2), which would start the ratio away from 1 and clip tokens the update never moved;
    # truncated importance weights (--tis-cap) correct for the tokens having been drawn from the sampler.
    old_lp = sampler_lp
    if cfg.tis_cap is not None or cfg.engine != "hf" or run.prec.dtype != torch.float32:
        old_lp = passes(lambda idx: token_logprobs(run.prec.model, rows_of(batch, idx), cfg.temperature,
                                                   mask=mask[idx])[0], skip=idle)
    tis = algos.tis_weights(old_lp, sampler_lp, cfg.tis_cap) if cfg.tis_cap is not None else None
    targets = {"adv": adv, "old_lp": old_lp, "sampler_lp": sampler_lp, "ref_lp": ref_lp, "tis": tis,
               "values": values, "returns": returns}
    # Sums over this rank, added over ranks at the end: losses weighted by their share of the global
    # loss (so their total is that loss), per-micro-batch statistics, sampler/trainer mismatch per token.
    acc = dict.fromkeys(("loss", "entropy", "kl", "value_loss", "clip_frac", "approx_kl", "micro_batches",
                         "logprob_diff", "logprob_kl", "mismatch_tokens", "padded", "real"), 0.0)
    grad_norms, before = [], []  # before: the first pass's rows and their log-probs before any update
    mbs = cfg.mini_batch_size // world if cfg.mini_batch_size else max(B, 1)  # trajectories per rank per step
    n_minis = all_max(-(-B // mbs))
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B).tolist()
        for s in range(n_minis):
            mini = perm[s * mbs:(s + 1) * mbs]  # may be empty on a rank with fewer trajectories
            (denominator,) = all_sum([algos.agg_denominator(mask[mini], cfg.loss_agg)])  # over all ranks
            for o in run.optims.values():
                o.zero_grad(set_to_none=True)
            live = [i for i in mini if i not in idle]  # the denominator above still counts the idle rows
            buckets = [[live[i] for i in b] for b in length_buckets([lengths[i] for i in live], cfg.micro_batch_tokens)]
            for idx in in_step(buckets):
                first = epoch == 0 and s == 0  # no optimizer step yet
                lp = micro_step(run, batch, mask, targets, idx, denominator, acc, first)
                if first and not before:
                    before.append((idx, lp))
            if not buckets and world == 1:  # every row idle: the zero gradient computing them would give
                for p in run.model.parameters():
                    p.grad = torch.zeros_like(p)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)))
            if run.critic is not None:
                torch.nn.utils.clip_grad_norm_(run.critic.parameters(), cfg.max_grad_norm)
            for o in run.optims.values():
                o.step()
            run.prec.sync()  # the bf16 copy from the new master weights (nothing to do in fp32)
    out = update_metrics(dict(zip(acc, all_sum(list(acc.values())))), cfg.ppo_epochs * n_minis, grad_norms,
                         run.critic is not None)
    out["idle_rows"] = all_sum([float(len(idle))])[0]
    out["update_kl"] = update_kl(run, batch, mask, before)
    return out


def update_kl(run, batch: dict, mask: torch.Tensor, before: list) -> float:
    """How far this step's update moved the policy: KL(before || after) per sampled token, the k3
    estimate on the tokens of the first micro-batch (they were sampled from the policy before the
    update), from their log-probs before the update (kept by the first pass) and after it (one more
    forward, without gradients). Measured by the trainer on both sides: the sampler's own rounding is
    not in it (logprob_diff is)."""
    kl_sum, tokens = 0.0, 0.0
    for idx, lp_before in before:  # one pass per rank: FSDP's forward is a collective
        T = lp_before.shape[1] + 1
        m = mask[idx, :T - 1]
        with torch.no_grad():
            lp_after, _ = token_logprobs(run.prec.model, {k: v[:, :T] for k, v in rows_of(batch, idx).items()},
                                         run.cfg.temperature, mask=m)
        sel = m > 0
        kl_sum += float(algos.kl_penalty(lp_before, lp_after, "k3", None)[sel].sum())
        tokens += float(sel.sum())
    kl_sum, tokens = all_sum([kl_sum, tokens])
    return kl_sum / tokens if tokens else None  # None: the first mini-batch held only rows without signal


def idle_rows(run, adv: torch.Tensor, mask: torch.Tensor, B: int) -> set[int]:
    """Rows that cannot move the weights: every sampled token's advantage is 0 (GRPO on a group whose
    outcomes all tie) and the loss has no KL, entropy or value term. They are never forwarded; the loss
    denominators still count them, so the update equals the one computing them (a zero gradient)."""
    cfg = run.cfg
    if cfg.kl_coef or cfg.entropy_coef or run.critic is not None:
        return set()
    signal = (adv[:B] * mask[:B]).abs().sum(-1).tolist()  # one pass over the batch, not one per row
    return {i for i, x in enumerate(signal) if x == 0}


def micro_step(run, batch: dict, mask, targets: dict, idx: list[int], denominator: float, acc: dict,
               first: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch (rows `idx`): clipped policy loss, entropy bonus, KL to the
    reference, the critic's value loss; the weighted losses and statistics are added to `acc`. Returns
    the rows' log-probs (b, T-1), detached."""
    cfg, world = run.cfg, world_size()
    B = batch["input_ids"].shape[0] - (world > 1)  # the trajectories; under torchrun row B is the blank one
    T = int(batch["attention_mask"][idx].sum(-1).max())  # cut the batch's padding
    mb = {k: v[:, :T] for k, v in rows_of(batch, idx).items()}
    mb_mask = mask[idx, :T - 1]
    cut = {k: None if v is None else v[idx, :T - 1] for k, v in targets.items()}
    w = micro_weight(mb_mask, denominator, cfg.loss_agg, world)
    share = w / world  # of the global mini-batch loss
    lp, ent = token_logprobs(run.prec.model, mb, cfg.temperature, with_entropy=True, mask=mb_mask)
    loss, pst = algos.policy_loss(lp, cut["old_lp"], cut["adv"], mb_mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                  cfg.loss_agg, cut["tis"])
    entropy = algos.agg_loss(ent, mb_mask, cfg.loss_agg)
    loss = loss - cfg.entropy_coef * entropy
    kl = torch.zeros(())
    if cut["ref_lp"] is not None:
        kl = algos.agg_loss(algos.kl_penalty(lp, cut["ref_lp"], cfg.kl_kind), mb_mask, cfg.loss_agg)
        loss = loss + cfg.kl_coef * kl
    if run.critic is not None:
        vloss, _ = algos.value_loss(run.critic(**mb)[:, :-1], cut["values"], cut["returns"], mb_mask, cfg.value_clip,
                                    cfg.loss_agg)
        (w * vloss).backward()
        acc["value_loss"] += share * float(vloss.detach())
    (w * loss).backward()
    run.prec.collect_grads()  # bf16 gradients into the fp32 master's, micro-batch by micro-batch
    for k, val in (("loss", loss), ("entropy", entropy), ("kl", kl)):
        acc[k] += share * float(val.detach())
    if idx == [B]:  # a blank pass: nothing to count
        return lp.detach()
    acc["padded"] += len(idx) * T
    acc["real"] += int(batch["attention_mask"][idx].sum())
    acc["micro_batches"] += 1
    acc["clip_frac"] += pst["clip_frac"]
    acc["approx_kl"] += pst["approx_kl"]
    if first:  # before any update: how far the trainer's log-probs are from the sampler's
        sel, mb_sampler = mb_mask > 0, cut["sampler_lp"]
        acc["logprob_diff"] += float((lp.detach() - mb_sampler).abs()[sel].sum())
        acc["logprob_kl"] += float(algos.kl_penalty(mb_sampler, lp.detach(), "k3", None)[sel].sum())
        acc["mismatch_tokens"] += float(sel.sum())
    return lp.detach()


def update_metrics(tot: dict, n_steps: int, grad_norms: list[float], critic: bool) -> dict:
    out = {k: tot[k] / n_steps for k in ("loss", "entropy", "kl") + (("value_loss",) if critic else ())}
    out.update({k: tot[k] / max(tot["micro_batches"], 1) for k in ("clip_frac", "approx_kl")})
    # KL(sampler || trainer) on the sampled tokens: k3 of log(pi_trainer / pi_sampler), the sampler's samples
    out.update({k: tot[k] / max(tot["mismatch_tokens"], 1) for k in ("logprob_diff", "logprob_kl")})
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["padding_share"] = 1 - tot["real"] / max(tot["padded"], 1)
    out["train_tokens"] = int(tot["real"])
    return out
