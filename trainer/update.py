"""The update's machinery, around the clipped loss that train.py writes out: the padded batch and
its micro-batches by length (models.policy.length_buckets), the rows that cannot move the weights,
the loss weights that make a torchrun update equal one process's, and the statistics of an update
(train.update_kl, how far the update moved the policy, reads the log-probs kept here).

Under torchrun every rank brings its own whole groups. FSDP's forward and backward are collectives,
so every rank runs as many passes as the busiest one, the extra ones on a blank row without sampled
tokens (weight 0); a rank may bring no trajectory at all.
"""

from __future__ import annotations

import torch

import algos
from models.policy import length_buckets
from rollout import Trajectory, build_batch
from trainer.distributed import all_max, all_sum, world_size


SKIP_IDLE = True  # off: idle rows are forwarded too, to the same update (tests/test_plain_layers)


class Rows:
    """A step's trajectories as a padded batch on the device (plus, under torchrun, one blank row
    at index B), and their micro-batches of similar length (at most --micro-batch-tokens each)."""

    def __init__(self, run, trajs: list[Trajectory]):
        self.B, self.world, self.max_tokens = len(trajs), world_size(), run.cfg.micro_batch_tokens
        blank = ([Trajectory("", -1, -1, [], [run.pad, run.pad], [0, 0], [0.0, 0.0])]
                 if self.world > 1 else [])
        self.trajs = list(trajs) + blank  # the rows, in order
        self.batch = {k: v.to(run.device) for k, v in build_batch(self.trajs, run.pad).items()}
        self.lengths = self.batch["attention_mask"].sum(-1).tolist()

    def micro_batches(self, rows: list[int], skip=frozenset()) -> list[list[int]]:
        """`rows` but `skip` (idle rows: nothing to compute, unless SKIP_IDLE is off) in length
        buckets, then blank passes up to the busiest rank's count."""
        rows = [i for i in rows if i not in skip] if SKIP_IDLE else list(rows)
        buckets = [[rows[j] for j in b]
                   for b in length_buckets([self.lengths[i] for i in rows], self.max_tokens)]
        return buckets + [[self.B]] * (all_max(len(buckets)) - len(buckets))

    def passes(self, fn, skip=frozenset()) -> torch.Tensor:
        """fn(rows, mask) -> (b, t-1) over every row but `skip`, without gradients: (B, T-1). Each
        micro-batch is cut to its longest row (t <= T), as the update's are: `rows` holds its
        input_ids, attention_mask, position_ids (b, t), `mask` its loss mask (b, t-1)."""
        mask = self.batch["loss_mask"][:, 1:]
        out = torch.zeros_like(mask)
        with torch.no_grad():
            for idx in self.micro_batches(list(range(self.B)), skip):
                t = max(self.lengths[i] for i in idx)
                rows = {k: self.batch[k][idx, :t]
                        for k in ("input_ids", "attention_mask", "position_ids")}
                out[idx, :t - 1] = fn(rows, mask[idx, :t - 1])
        return out


def micro_weight(mask_micro: torch.Tensor, denominator: float, mode: str, world: int = 1) -> float:
    """The factor w = world * agg_denominator(micro) / denominator on a micro-batch's loss before
    backward, `denominator` being agg_denominator of the whole mini-batch on all ranks: the
    accumulated gradients are then those of the mini-batch's loss, in every aggregation mode (the
    factor `world` undoes FSDP's averaging over ranks: sum_ranks sum_micro w/world * loss_micro =
    the global loss)."""
    return world * algos.agg_denominator(mask_micro, mode) / max(denominator, 1.0)


def idle_rows(run, adv: torch.Tensor, mask: torch.Tensor, B: int) -> set[int]:
    """Rows that cannot move the weights: every sampled token's advantage is 0 (GRPO on a group
    whose outcomes all tie) and the loss has no KL, entropy or value term. They are never forwarded;
    the loss denominators still count them, so the update equals the one computing them (a zero
    gradient)."""
    cfg = run.cfg
    if cfg.kl_coef or cfg.entropy_coef or run.critic is not None:
        return set()
    signal = (adv[:B] * mask[:B]).abs().sum(-1).tolist()  # one pass over the batch, not one per row
    return {i for i, x in enumerate(signal) if x == 0}


class UpdateStats:
    """Sums over this rank, added over ranks at the end: losses weighted by their share of the
    global loss (so their total is that loss), per-micro-batch statistics, sampler/trainer mismatch
    per token; and the first mini-batch's log-probs before any optimizer step, for update_kl."""

    KEYS = ("loss", "entropy", "kl", "value_loss", "clip_frac", "approx_kl", "micro_batches",
            "logprob_diff", "logprob_kl", "mismatch_tokens", "padded", "real", "share")

    def __init__(self):
        self.acc = dict.fromkeys(self.KEYS, 0.0)
        self.grad_norms, self.before, self.first = [], [], False

    def add(self, rows: Rows, idx, T, share, loss, entropy, kl, vloss, pst, lp, mb_mask, cut):
        acc = self.acc
        for k, val in (("loss", loss), ("entropy", entropy), ("kl", kl)):
            acc[k] += share * float(val.detach())
        acc["share"] += share
        if vloss is not None:
            acc["value_loss"] += share * float(vloss.detach())
        if self.first:
            self.before.append((idx, lp))
        if idx == [rows.B]:  # a blank pass: nothing to count
            return
        acc["padded"] += len(idx) * T
        acc["real"] += int(rows.batch["attention_mask"][idx].sum())
        acc["micro_batches"] += 1
        acc["clip_frac"] += pst["clip_frac"]
        acc["approx_kl"] += pst["approx_kl"]
        if self.first:  # before any update: how far the trainer's log-probs are from the sampler's
            sel, mb_sampler = mb_mask > 0, cut["sampler_lp"]
            acc["logprob_diff"] += float((lp - mb_sampler).abs()[sel].sum())
            acc["logprob_kl"] += float(algos.kl_penalty(mb_sampler, lp, "k3", None)[sel].sum())
            acc["mismatch_tokens"] += float(sel.sum())

    def metrics(self, run, batch: dict, mask, n_steps: int, idle: int) -> dict:
        tot = dict(zip(self.acc, all_sum(list(self.acc.values()))))
        keys = ("loss", "entropy", "kl") + (("value_loss",) if run.critic is not None else ())
        out = {k: tot[k] / n_steps for k in keys}
        # the entropy of the rows forwarded: idle rows (train.idle_rows) add 0 to the loss, which
        # is exact, but their entropy is not known
        out["entropy"] = tot["entropy"] / max(tot["share"], 1e-12)
        out.update({k: tot[k] / max(tot["micro_batches"], 1) for k in ("clip_frac", "approx_kl")})
        # KL(sampler || trainer) on the sampled tokens: k3 of log(pi_trainer / pi_sampler)
        out.update({k: tot[k] / max(tot["mismatch_tokens"], 1)
                    for k in ("logprob_diff", "logprob_kl")})
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        out["padding_share"] = 1 - tot["real"] / max(tot["padded"], 1)
        out["train_tokens"] = int(tot["real"])
        out["idle_rows"] = all_sum([float(idle)])[0]
        return out


def update_run(cfg, model, optims: dict, dtype: torch.dtype = torch.float32, **fields):
    """What train.advantages and train.update read of a run (trainer/run.py's `Run`), for calling
    them on a model directly (the tests, bench/replay_step.py, bench/rollout_overhead.py): the
    model computing in `dtype` (models.policy.Precision) on the CPU; `fields` (ref, critic, pad,
    compute_dtype, ...) add to these or replace them."""
    from types import SimpleNamespace

    from models.policy import Precision
    return SimpleNamespace(**{
        "cfg": cfg, "model": model, "prec": Precision(model, dtype), "compute_dtype": dtype,
        "optims": optims, "ref": None, "critic": None, "pad": 0, "device": torch.device("cpu"),
        "engine_kind": cfg.engine, "lr_scale": 1.0,
        "update_gen": torch.Generator().manual_seed(cfg.seed), **fields})
