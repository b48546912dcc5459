"""Multi-turn RL for LLM agents (AgentGym-RL), top to bottom: config, the loop, the update.

    python train.py --env textcraft --schedule 10,20,30       # ScalingInter-RL: 3 stages
    python train.py --env babyai --schedule 15 --algo ppo      # fixed horizon, PPO + critic
    python train.py --env corridor --steps 40 --out runs/c --resume   # continue a run
    torchrun --nproc-per-node 8 train.py --env textcraft --model Qwen/Qwen2.5-7B-Instruct

A step, in `main`'s order: the horizon K; the rollout (rollout.py); which trajectories are
trained on; the learning rate; the advantages (algos.py); the update by the clipped loss (its
ratio's denominator chosen in `update`); the --max-update-kl guard; the new weights to the
sampler; a line of metrics. The boundaries (engine, env pool, distributed.py, trainer/run.py)
change speed, robustness and logs, never what is computed (tests/test_plain_layers.py). `run`
(trainer/run.py's Run) holds what setup made: cfg, engine, fmt, pool, schedule, model (fp32
master weights), prec.model (what computes: model or its bf16 copy), ref, critic, optims.
"""

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before OpenMP loads: trainer/cli.py
import math
import time

import torch
from tqdm import tqdm

import algos  # the formulas: advantages, losses, the trainer's log-probs (token_logprobs)
from distributed import (Rows, all_gather_list, all_max, all_sum, global_whiten, idle_rows,
                         world_size)  # the update's rows over passes and torchrun's processes
from rollout import (EnginePolicy, RolloutConfig, Trajectory, informative_groups, rollout,
                     turn_state_keys)
from trainer import config  # the flags, their checks and the real-model settings
from trainer import setup  # a run set up (models, engine, env, --resume) and ended
from trainer.run import generating, log_rollout, rollout_metrics  # the loop's engine and logs
from trainer.run import UpdateStats  # the update's statistics


# ================================================================ the loop
def parse_args(argv=None) -> config.Config:
    return config.parse_args(argv, __doc__)


def main(cfg: config.Config) -> dict:
    with setup.started(cfg) as run:  # models, engine, env pool, tasks; or a checkpoint's
        for step in run.steps():  # between steps: evaluations, checkpoints, signals
            K = run.schedule.max_turns(step)  # ScalingInter-RL: K grows stage by stage
            # ---- rollout: batch_size tasks x group_size samples each, up to K turns
            t0, rcfg = time.time(), RolloutConfig.of(cfg, K)
            item_ids, groups = run.tasks_for_step()
            policy = EnginePolicy(run.engine, run.fmt, rcfg, run.sample_gen)
            progress = run.progress(K)

            def play(items, groups):
                with generating(run):  # vLLM awake; under torchrun HF weights gathered
                    return rollout(policy, run.pool, cfg.env, items, groups, rcfg,
                                   fmt=run.fmt, agent=cfg.agent, progress=progress)

            trajs = play(item_ids, groups)
            # ---- which trajectories are trained on
            played = all_gather_list(trajs)  # every rank's: for metrics and the log
            metrics = rollout_metrics(played, K)
            n_played, errors = len(played), metrics["status_env_error"]
            # Too many env errors leave a biased sample (say, only the short episodes)
            metrics["bad"] = errors > cfg.max_env_error_share * n_played
            if not metrics["bad"]:  # a plateau schedule moves on when success stops improving
                run.schedule.observe(step, metrics["success_rate"])
            if cfg.dynamic_sampling:  # tied groups carry no signal: more rounds replace them
                trajs, extra = resample(run, trajs, play, metrics)
                played += extra
            kept = [t for t in trajs if t.status != "env_error"]  # an error is no reward
            log_rollout(run, step, K, played, metrics, time.time() - t0)
            spoilt = metrics["bad"] or errors == n_played  # by env errors
            trainable = not spoilt and (kept or world_size() > 1)
            with run.critical():  # a signal here waits: never save half an update
                t1 = time.time()
                if trainable:  # under torchrun every rank takes part, with or without rows
                    run.show(f"update of {len(kept)} trajectories")
                    torch.set_num_threads(run.update_threads)  # the update makes no env call
                    metrics["lr"] = set_lr(run, step)
                    # ---- the batch: one padded row per trajectory, micro-batched by length
                    rows = Rows(run, kept)
                    # ---- advantages: algos.ESTIMATORS[--algo], per sampled token
                    adv, returns, values = advantages(run, rows)
                    # ---- the update: ppo_epochs x mini-batches of the clipped loss
                    metrics.update(update(run, rows, adv, returns, values))
                guard(run, step, metrics)  # --max-update-kl: too far a move halves later rates
                metrics["time_update_s"] = time.time() - t1
                # ---- the sampler gets the weights (HF: has them, drops its KV cache), timed
                sync_s = run.engine.sync_weights(run.prec.model) if trainable else 0.0
                metrics["time_sync_s"] = sync_s  # no update: nothing new to copy
                run.log(step, metrics)  # metrics.jsonl, reporters; a stop now saves this step
    return run.summary


def resample(run, trajs: list[Trajectory], play, metrics: dict) -> tuple[list, list]:
    """Dynamic sampling (one process only): tied groups carry no signal, so up to --max-resample
    more rounds of play(items, groups) run until --batch-size groups are informative. --resample
    fresh (DAPO): a fresh task under a new group id replaces a tied group; extend: its own task
    --group-size more times under its id (a task solved 1 time in 8 shows its win). Returns
    (those to train on, the extra played); the counts into `metrics`."""
    cfg = run.cfg
    keep = informative_groups(trajs)
    kept = [t for t in trajs if t.group in keep]
    tied = {t.group: t.item_id for t in trajs if t.group not in keep}  # group -> its task
    extra, next_group = [], max(t.group for t in trajs) + 1
    for _ in range(cfg.max_resample):
        missing = cfg.batch_size - len({t.group for t in kept})
        if missing <= 0 or not tied:
            break
        if cfg.resample == "extend":  # the tied groups' own tasks again, under their own ids
            groups = [g for g in sorted(tied) for _ in range(cfg.group_size)]
            item_ids = [tied[g] for g in groups]
        else:  # a fresh task for each missing group, drawn in each round
            fresh = run.data_rng.sample(run.train_ids, min(missing, len(run.train_ids)))
            item_ids = [i for i in fresh for _ in range(cfg.group_size)]
            groups = [next_group + k // cfg.group_size for k in range(len(item_ids))]
            next_group += len(fresh)
        extra += play(item_ids, groups)
        grown = [t for t in trajs + extra if t.group in groups]  # a group's every round
        keep = informative_groups(grown)
        kept += [t for t in grown if t.group in keep]
        if cfg.resample == "extend":
            tied = {t.group: t.item_id for t in grown if t.group not in keep}
    metrics["resampled_groups"] = len({t.group for t in extra})
    metrics["trained_groups"] = len({t.group for t in kept})
    return kept, extra


def set_lr(run, step: int) -> float:
    """This step's learning rates into the optimizers: the base rate (--lr, --critic-lr) x the
    schedule's share (`lr_at`) x the guard's scale; returns the policy's."""
    cfg = run.cfg
    share = lr_at(step, cfg.steps, cfg.lr_decay, cfg.warmup_steps or 0) * run.lr_scale
    for name, o in run.optims.items():
        for g in o.param_groups:
            g["lr"] = share * (cfg.lr if name == "policy" else cfg.critic_lr)
    return share * cfg.lr


def lr_at(step: int, steps: int, decay: str, warmup: int = 0) -> float:
    """The base rate's share at `step` of `steps`: 1, or with --lr-decay linear or cosine down
    to 1/steps at the last step (never 0), times s / (warmup + 1) at a step
    s <= --warmup-steps (Adam's first steps are full size whatever the gradient's scale)."""
    low = 1.0 / steps
    ramp = step / (warmup + 1) if step <= warmup else 1.0
    if decay == "linear":
        return ramp * (1.0 - (step - 1) / steps)
    if decay == "cosine":
        t = (step - 1) / (steps - 1) if steps > 1 else 0.0
        return ramp * (low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * t)))
    return ramp


def guard(run, step: int, metrics: dict) -> None:
    """--max-update-kl: a step whose update moved the policy past the bound (update_kl) halves
    the learning rate of every step after it (run.lr_scale, kept in checkpoints)."""
    bound, kl = run.cfg.max_update_kl, metrics.get("update_kl")
    if bound and kl is not None and kl > bound:
        run.lr_scale *= 0.5
        tqdm.write(f"step {step}: update_kl {kl:.2e} > --max-update-kl {bound:g}: learning rate "
                   f"halved to {run.lr_scale:g} x the schedule's from step {step + 1}")
    metrics["lr_scale"] = run.lr_scale


# ================================================================ one update
def advantages(run, rows: Rows) -> tuple:
    """(advantages, returns, values), each (rows, T-1) on sampled tokens, by --algo.
    Whitening sees every rank's tokens (global_whiten), as one process with all rows would."""
    cfg, batch, trajs = run.cfg, rows.batch, rows.trajs
    mask = batch["loss_mask"][:, 1:]  # token t+1's at t, where its logits are
    estimator = algos.estimator(cfg.algo)
    values = None
    if estimator.critic:  # V of the prefix that produced token t+1
        values = rows.passes(lambda mb, mb_mask: run.critic(**mb)[:, :-1])
    keys = [turn_state_keys(t) for t in trajs] if cfg.algo == "gigpo" else None
    inputs = algos.AdvantageInputs(batch["rewards"], batch["group_ids"], mask, values, cfg.gamma,
                              cfg.lam, whiten=global_whiten,
                              turn_ids=batch["turn_ids"][:, 1:],  # shifted as the mask
                              state_keys=keys, turn_rewards=[t.turn_rewards for t in trajs],
                              step_adv_weight=cfg.step_adv_weight)
    adv, returns = estimator.fn(inputs)
    return adv, returns, values


def update(run, rows: Rows, adv, returns, values) -> dict:
    """`ppo_epochs` passes of the clipped loss over mini-batches, micro-batched by length;
    under torchrun, one process's update on every rank's rows: each micro-batch's loss weighs
    its share (`micro_weight`), and a rank short of micro-batches runs blank ones (FSDP)."""
    cfg, world, B = run.cfg, world_size(), rows.B
    # Token t+1's mask and sampler log-prob sit at t, where the logits that produced it are
    mask = rows.batch["loss_mask"][:, 1:]  # (rows, T-1): B, and torchrun's blank row
    sampler_lp = rows.batch["old_logprobs"][:, 1:]
    idle = idle_rows(run, adv, mask, B)  # all-0 advantages, no KL/entropy: skipped
    ref_lp = None if run.ref is None else logprobs(run, run.ref, rows)  # the initial policy's
    # The PPO ratio's denominator: the sampler's own log-probs where they are the trainer's
    # numbers, in fp32 (HF 9e-6 apart a token, vLLM 3.4e-6: bench/sampler_gap.py); else the
    # trainer's, recomputed: in bf16 a cached decode and a whole-row forward round differently
    # (0.04 a token), vLLM renormalises a top_p < 1 nucleus, and --tis-cap compares the two.
    recompute = (cfg.tis_cap is not None or run.compute_dtype != torch.float32
                 or (run.engine_kind != "hf" and cfg.top_p < 1))
    old_lp = logprobs(run, run.prec.model, rows, skip=idle) if recompute else sampler_lp
    tis = None if cfg.tis_cap is None else algos.tis_weights(old_lp, sampler_lp, cfg.tis_cap)
    targets = {"adv": adv, "old_lp": old_lp, "sampler_lp": sampler_lp, "ref_lp": ref_lp,
               "tis": tis, "values": values, "returns": returns}
    stats = UpdateStats()
    per_mini = cfg.mini_batch_size // world if cfg.mini_batch_size else max(B, 1)  # this rank's
    n_minis = all_max(-(-B // per_mini))
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B, generator=run.update_gen).tolist()
        for s in range(n_minis):
            mini = perm[s * per_mini:(s + 1) * per_mini]  # empty on a rank with fewer trajectories
            (loss_norm,) = all_sum([algos.agg_denominator(mask[mini], cfg.loss_agg)])
            for o in run.optims.values():
                o.zero_grad(set_to_none=True)
            stats.first = epoch == 0 and s == 0  # no optimizer step yet
            for idx in rows.micro_batches(mini, skip=idle):
                micro_step(run, rows, targets, idx, loss_norm, stats)
            if world == 1 and not any(p.grad is not None for p in run.model.parameters()):
                for p in run.model.parameters():  # all rows idle: the zero gradient they give
                    p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
            stats.grad_norms.append(float(norm))
            if run.critic is not None:
                torch.nn.utils.clip_grad_norm_(run.critic.parameters(), cfg.max_grad_norm)
            if math.isfinite(norm):  # a NaN or inf gradient is not applied: grad_norm says so
                for o in run.optims.values():
                    o.step()
            run.prec.sync()  # the bf16 copy from the new fp32 master weights (fp32: nothing)
    metrics = stats.metrics(run, cfg.ppo_epochs * n_minis, len(idle))
    metrics["update_kl"] = update_kl(run, rows, idle, stats.before)  # for the guard
    return metrics


def logprobs(run, model, rows: Rows, skip=frozenset()) -> torch.Tensor:
    """`model`'s log-probs of the rows' tokens, (rows, T-1), no gradients (0 on `skip`)."""
    t = run.cfg.temperature
    return rows.passes(lambda mb, mask: algos.token_logprobs(model, mb, t, mask=mask)[0], skip)


def micro_step(run, rows, targets: dict, idx: list[int], loss_norm: float, stats):
    """Forward and backward of a micro-batch (rows `idx`): the clipped policy loss and the
    entropy bonus (and the options' terms: `option_terms`); statistics to `stats`."""
    cfg, world = run.cfg, world_size()
    mb, mb_mask = rows.cut(idx)  # cut to the longest row: no column of padding only
    mine = {k: None if v is None else v[idx, :mb_mask.shape[1]] for k, v in targets.items()}
    weight = micro_weight(mb_mask, loss_norm, cfg.loss_agg, world)  # its share of the loss
    lp, ent = algos.token_logprobs(run.prec.model, mb, cfg.temperature, mask=mb_mask,
                             with_entropy=True)
    loss, clip_stats = algos.policy_loss(lp, mine["old_lp"], mine["adv"], mb_mask, cfg.clip_low,
                                         cfg.clip_high, cfg.dual_clip, cfg.loss_agg, mine["tis"])
    entropy = algos.agg_loss(ent, mb_mask, cfg.loss_agg)
    loss = loss - cfg.entropy_coef * entropy
    terms = {"entropy": entropy}
    if run.ref is not None or run.critic is not None:  # --kl-coef, --algo ppo
        loss = option_terms(run, mb, mb_mask, lp, mine, weight, loss, terms)
    (weight * loss).backward()
    run.prec.collect_grads()  # bf16 gradients into the fp32 master's, each micro-batch
    stats.add(rows, idx, share=weight / world, terms={"loss": loss, **terms}, clip=clip_stats,
              lp=lp.detach(), mask=mb_mask, sampler_lp=mine["sampler_lp"])


def option_terms(run, mb, mask, lp, mine: dict, weight: float, loss, terms: dict):
    """The terms off by default: the KL to the reference (--kl-coef), added to the loss it
    returns; the critic's value loss (--algo ppo), its own backward here. Both into `terms`."""
    cfg = run.cfg
    if mine["ref_lp"] is not None:
        kl_tokens = algos.kl_penalty(lp, mine["ref_lp"], cfg.kl_kind)
        terms["kl"] = algos.agg_loss(kl_tokens, mask, cfg.loss_agg)
        loss = loss + cfg.kl_coef * terms["kl"]
    if run.critic is not None:
        values = run.critic(**mb)[:, :-1]
        terms["value_loss"] = algos.value_loss(values, mine["values"], mine["returns"], mask,
                                                  cfg.value_clip, cfg.loss_agg)
        (weight * terms["value_loss"]).backward()
    return loss


def micro_weight(mask_micro, loss_norm: float, mode: str, world: int = 1) -> float:
    """A micro-batch's loss weight, world * agg_denominator(micro) / loss_norm (the mini-batch's
    over all ranks): the gradients add up to the mini-batch loss's in every --loss-agg mode;
    `world` undoes FSDP's average over ranks."""
    return world * algos.agg_denominator(mask_micro, mode) / max(loss_norm, 1.0)


def update_kl(run, rows: Rows, idle: set[int], before: list) -> float | None:
    """How far the update moved the policy: k3 KL(before || after) per sampled token of the
    first mini-batch's moving rows (before: its first passes; after: one more forward)."""
    kl_sum, tokens = 0.0, 0.0
    moves = torch.tensor([i not in idle for i in range(len(rows.trajs))], device=run.device)
    for idx, lp_before in before:  # as many on every rank: FSDP's forward is a collective
        mb, mask = rows.cut(idx)
        with torch.no_grad():
            lp_after, _ = algos.token_logprobs(run.prec.model, mb, run.cfg.temperature, mask=mask)
        sel = (mask > 0) & moves[idx][:, None]
        kl_sum += float(algos.kl_penalty(lp_before, lp_after, "k3", None)[sel].sum())
        tokens += float(sel.sum())
    kl_sum, tokens = all_sum([kl_sum, tokens])
    return kl_sum / tokens if tokens else None  # None: the first mini-batch was all idle


if __name__ == "__main__":
    main(parse_args())
