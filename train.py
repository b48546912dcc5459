"""Multi-turn RL for LLM agents (AgentGym-RL), top to bottom: config, the loop, the update.

    python train.py --env textcraft --schedule 10,20,30       # ScalingInter-RL, 3 horizon stages
    python train.py --env babyai --schedule 15 --algo ppo      # fixed horizon, PPO with a critic
    python train.py --env corridor --steps 40 --out runs/c --resume   # continue a run
    torchrun --nproc-per-node 8 train.py --env textcraft --model Qwen/Qwen2.5-7B-Instruct

One step: the schedule gives the horizon K; `batch_size` tasks x `group_size` copies are played for
up to K turns (rollout.py); each trajectory is one row of token ids whose loss mask marks the tokens
the policy sampled; the estimator --algo turns outcomes into per-token advantages (algos.py);
`ppo_epochs` passes of the clipped loss over mini-batches move the policy; the engine gets the new
weights; one line of metrics. What is not the algorithm lives in layers (trainer/, models/), each
called at one named point below: the flags and their checks, torchrun, the run around the loop
(setup, checkpoints, resume, signals, evaluations, dynamic sampling, the summary). `run` holds what
setup made: cfg, engine, fmt (chat template), pool (env instances), schedule, model (the fp32
master weights), prec.model (the copy that computes: the master, or its bf16 copy), ref, critic,
optims.
"""

from __future__ import annotations

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (trainer/cli.py)
import time

import torch

import algos
from models.policy import token_logprobs  # the trainer's log-probs of the sampled tokens
from rollout import EnginePolicy, RolloutConfig, rollout, turn_state_keys
from trainer import config  # the flags, their checks and the real-model settings
from trainer import run as layer  # the run around the loop: setup, resume, checkpoints, evaluations
from trainer.distributed import all_max, all_sum, global_whiten, world_size  # torchrun
from trainer.update import Rows, UpdateStats, idle_rows, micro_weight  # the update's machinery


# ================================================================ the loop
def parse_args(argv=None) -> config.Config:
    return config.parse_args(argv, __doc__)


def main(cfg: config.Config) -> dict:
    with layer.started(cfg) as run:  # models, engine, env pool, tasks; --resume: the checkpoint's
        for step in run.steps():  # progress bar; evaluations, checkpoints and signals between steps
            K = run.schedule.max_turns(step)  # ScalingInter-RL: the horizon grows stage by stage
            # ---- rollout: batch_size tasks x group_size samples each, up to K turns
            t0 = time.time()
            rcfg = RolloutConfig.of(cfg, K)
            item_ids, groups = run.tasks_for_step()
            policy = EnginePolicy(run.engine, run.fmt, rcfg, run.sample_gen)
            progress = run.progress(K)

            def play(items, groups):
                with layer.generating(run):  # vLLM woken up; under torchrun HF weights gathered
                    return rollout(policy, run.pool, cfg.env, items, groups, rcfg, fmt=run.fmt,
                                   agent=cfg.agent, progress=progress)

            trajs = play(item_ids, groups)
            trajs, m = layer.after_rollout(run, step, K, trajs, play, time.time() - t0)
            kept = [t for t in trajs if t.status != "env_error"]  # env failures are not rewards
            with run.critical(step, m):  # a signal here waits: never save half an update
                t1 = time.time()
                if layer.trainable(run, m, kept):
                    m["lr"] = run.set_lr(step)
                    # ---- the batch: build_batch's rows on the device, micro-batched by length
                    rows = Rows(run, kept)
                    # ---- advantages: algos.ESTIMATORS[--algo], per sampled token
                    adv, returns, values = advantages(run, rows)
                    # ---- the update: ppo_epochs x mini-batches of the clipped loss
                    m.update(update(run, rows, adv, returns, values))
                m["time_update_s"] = time.time() - t1
                m["time_sync_s"] = float(run.engine.sync_weights(run.prec.model) or 0.0)
                run.log(step, m)
    return run.summary


# ================================================================ one update
def advantages(run, rows: Rows) -> tuple:
    """(advantages, returns, values), each (B, T-1) on sampled tokens, by the --algo estimator.
    Whitening uses every rank's tokens (global_whiten), as one process holding all rows would."""
    cfg, batch, trajs = run.cfg, rows.batch, rows.trajs
    mask = batch["loss_mask"][:, 1:]  # token t+1's, at t: where the logits that produced it are
    est = algos.estimator(cfg.algo)
    values = None
    if est.critic:  # V of the prefix that produced token t+1
        values = rows.passes(lambda idx: run.critic(**rows_of(batch, idx))[:, :-1])
    x = algos.AdvantageInputs(batch["rewards"], batch["group_ids"], mask, values, cfg.gamma,
                              cfg.lam, whiten=global_whiten,
                              turn_ids=batch["turn_ids"][:, 1:],  # shifted as the mask
                              state_keys=[turn_state_keys(t) for t in trajs],  # GiGPO's anchors
                              turn_rewards=[t.turn_rewards for t in trajs],
                              step_adv_weight=cfg.step_adv_weight)
    adv, returns = est.fn(x)
    return adv, returns, values


def update(run, rows: Rows, adv, returns, values) -> dict:
    """`ppo_epochs` passes of the clipped loss over mini-batches, micro-batched by length. Under
    torchrun the update equals one process's on every rank's trajectories: each micro-batch's loss
    is weighted by its share of the global loss (`micro_weight`), and a rank with fewer
    micro-batches than the busiest runs blank ones (FSDP's passes are collectives)."""
    cfg, world, batch, B = run.cfg, world_size(), rows.batch, rows.B
    # Token t+1's mask and sampler log-prob sit at t, where the logits that produced it are (B, T-1)
    mask, sampler_lp = batch["loss_mask"][:, 1:], batch["old_logprobs"][:, 1:]
    idle = idle_rows(run, adv, mask, B)  # rows whose every advantage is 0: never forwarded
    ref_lp = None
    if run.ref is not None:  # the KL reference: the initial policy
        ref_lp = rows.passes(lambda idx: token_logprobs(run.ref, rows_of(batch, idx),
                                                        cfg.temperature, mask=mask[idx])[0])
    # The PPO ratio's denominator: the sampler's own log-probs where they are the trainer's
    # numbers, in fp32 (HF or vLLM: 3.4e-6 apart a token, bench/sampler_gap.py); else the
    # trainer's, recomputed: in bf16 a cached decode and a whole-row forward round differently
    # (0.04 a token), vLLM renormalises a top_p < 1 nucleus, and --tis-cap compares the two.
    old_lp = sampler_lp
    if (cfg.tis_cap is not None or run.compute_dtype != torch.float32
            or (run.engine_kind != "hf" and cfg.top_p < 1)):
        old_lp = rows.passes(lambda idx: token_logprobs(run.prec.model, rows_of(batch, idx),
                                                        cfg.temperature, mask=mask[idx])[0],
                             skip=idle)
    tis = algos.tis_weights(old_lp, sampler_lp, cfg.tis_cap) if cfg.tis_cap is not None else None
    targets = {"adv": adv, "old_lp": old_lp, "sampler_lp": sampler_lp, "ref_lp": ref_lp, "tis": tis,
               "values": values, "returns": returns}
    stats = UpdateStats()
    mbs = cfg.mini_batch_size // world if cfg.mini_batch_size else max(B, 1)  # rows per rank
    n_minis = all_max(-(-B // mbs))
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B, generator=run.update_gen).tolist()
        for s in range(n_minis):
            mini = perm[s * mbs:(s + 1) * mbs]  # may be empty on a rank with fewer trajectories
            (denominator,) = all_sum([algos.agg_denominator(mask[mini], cfg.loss_agg)])
            for o in run.optims.values():
                o.zero_grad(set_to_none=True)
            stats.first = epoch == 0 and s == 0  # no optimizer step yet
            for idx in rows.micro_batches([i for i in mini if i not in idle]):
                micro_step(run, rows, mask, targets, idx, denominator, stats)
            if world == 1 and not any(p.grad is not None for p in run.model.parameters()):
                for p in run.model.parameters():  # all rows idle: the zero gradient they give
                    p.grad = torch.zeros_like(p)
            stats.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(run.model.parameters(),
                                                                         cfg.max_grad_norm)))
            if run.critic is not None:
                torch.nn.utils.clip_grad_norm_(run.critic.parameters(), cfg.max_grad_norm)
            for o in run.optims.values():
                o.step()
            run.prec.sync()  # the bf16 copy from the new fp32 master weights (fp32: nothing)
    return stats.metrics(run, batch, mask, cfg.ppo_epochs * n_minis, len(idle))


def micro_step(run, rows, mask, targets: dict, idx: list[int], denominator: float, stats) -> None:
    """Forward and backward of one micro-batch (rows `idx`): the clipped policy loss, the entropy
    bonus, the KL to the reference, the critic's value loss; their statistics into `stats`."""
    cfg, world, batch = run.cfg, world_size(), rows.batch
    T = int(batch["attention_mask"][idx].sum(-1).max())  # cut the batch's padding
    mb = {k: v[:, :T] for k, v in rows_of(batch, idx).items()}
    mb_mask = mask[idx, :T - 1]
    cut = {k: None if v is None else v[idx, :T - 1] for k, v in targets.items()}
    w = micro_weight(mb_mask, denominator, cfg.loss_agg, world)  # its share of the loss
    lp, ent = token_logprobs(run.prec.model, mb, cfg.temperature, with_entropy=True, mask=mb_mask)
    loss, pst = algos.policy_loss(lp, cut["old_lp"], cut["adv"], mb_mask, cfg.clip_low,
                                  cfg.clip_high, cfg.dual_clip, cfg.loss_agg, cut["tis"])
    entropy = algos.agg_loss(ent, mb_mask, cfg.loss_agg)
    loss = loss - cfg.entropy_coef * entropy
    kl = torch.zeros(())
    if cut["ref_lp"] is not None:
        kl = algos.agg_loss(algos.kl_penalty(lp, cut["ref_lp"], cfg.kl_kind), mb_mask, cfg.loss_agg)
        loss = loss + cfg.kl_coef * kl
    vloss = None
    if run.critic is not None:
        vloss, _ = algos.value_loss(run.critic(**mb)[:, :-1], cut["values"], cut["returns"],
                                    mb_mask, cfg.value_clip, cfg.loss_agg)
        (w * vloss).backward()
    (w * loss).backward()
    run.prec.collect_grads()  # bf16 gradients into the fp32 master's, micro-batch by micro-batch
    stats.add(rows, idx, T, w / world, loss, entropy, kl, vloss, pst, lp.detach(), mb_mask, cut)


def rows_of(batch: dict, idx: list[int]) -> dict:
    return {k: batch[k][idx] for k in ("input_ids", "attention_mask", "position_ids")}


if __name__ == "__main__":
    main(parse_args())
