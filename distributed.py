"""How the update's rows are distributed: over passes (`build_batch`: the rows as padded
tensors; `Rows`: in micro-batches of similar length, `length_buckets`, less the rows that cannot
move the weights, `idle_rows`) and over torchrun's processes (the process group, small
collectives, which rows each rank plays, `Precision`: FSDP's mixed precision on one process, bf16
compute and fp32 masters). None of it changes what a step computes (tests/test_plain_layers.py).

With one process every collective is a no-op (world size 1): train.py reads the same either way.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os

import torch
import torch.distributed as dist

import algos
from rollout import Trajectory


# ---------------------------------------------------------------- distributed (torchrun)
# `torchrun --nproc-per-node N train.py ...` starts N copies of this script with RANK,
# WORLD_SIZE and LOCAL_RANK set: one per GPU (NCCL), or N CPU processes (gloo). All ranks
# draw the same tasks from the shared data RNG and each plays its block of whole groups
# (rank_items) with its own sampling seed and its own env server (started per rank: N servers
# step envs in parallel, where one server process would hold all ranks' game steps on one
# GIL; with --env-addr all ranks share that server). The trajectories are gathered to every
# rank for the metrics, which are therefore over all of them. The policy, the reference model
# and the critic are sharded with FSDP2 (shard_model); a single process keeps plain modules
# and every helper below is then a no-op.
def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device); joins the process group when started by torchrun."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    dev = torch.device(device)
    if dev.type == "cuda":
        local, gpus = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        # NCCL would fail deep inside init_process_group on a GPU that is not there
        if local >= gpus:
            procs = int(os.environ.get('LOCAL_WORLD_SIZE', world))
            raise SystemExit(f"torchrun: {procs} processes on this node but {gpus} GPU(s): "
                             f"use --nproc-per-node {gpus} or less, or --device cpu (gloo)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    # Ranks wait for each other at every gather: the slowest rank's rollout (or rank 0
    # building the warm start) must fit in the timeout.
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(hours=2),
                            device_id=dev if dev.type == "cuda" else None)
    return dist.get_rank(), world, dev


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _comm_device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums over ranks (float64: counts stay exact)."""
    if world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def all_max(n: int) -> int:
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def all_gather_list(items: list) -> list:
    """Every rank's list joined in rank order, on every rank (pickled: small objects only)."""
    if world_size() == 1:
        return list(items)
    parts: list = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def broadcast_value(value):
    """Rank 0's value, on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def rank_items(chosen: list[int], batch_size: int, group_size: int, rank: int = 0,
               world: int = 1):
    """This rank's rows of a step: (item ids, group ids). Every rank gets the same `chosen`
    tasks; slot g = 0..batch_size-1 is a group of group_size copies of chosen[g] (the list
    repeated when shorter), and rank r plays the r-th block of batch_size / world slots. So a
    group (its advantages computed within it) never straddles ranks, group ids are global,
    and the ranks' rows in rank order are the rows one process plays."""
    assert batch_size % world == 0, f"batch_size {batch_size} not divisible by {world} ranks"
    per = batch_size // world
    slots = range(rank * per, (rank + 1) * per)
    return ([chosen[g % len(chosen)] for g in slots for _ in range(group_size)],
            [g for g in slots for _ in range(group_size)])


@contextlib.contextmanager
def gathered(model):
    """Every FSDP unit of `model` unsharded for the duration, for HF generate: each rank
    generates alone, for as many forward passes as its own trajectories need, so the per-layer
    all-gathers of a sharded forward would not match across ranks. The full weights are
    gathered once, together."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)  # back to shard_model's settings
        model.set_reshard_after_forward(False, recurse=False)
        for m in units:
            m.reshard()


def global_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """algos.masked_whiten(x, mask) * mask with the mean and unbiased variance of every rank's
    sampled tokens, i.e. what one process holding all trajectories computes."""
    if world_size() == 1:
        return algos.masked_whiten(x, mask) * mask
    m = (mask > 0).float()
    total, n = all_sum([float((x * m).sum()), float(m.sum())])
    mean = total / max(n, 1.0)
    (sq_dev,) = all_sum([float(((x - mean) ** 2 * m).sum())])
    scale = 1.0 / math.sqrt(sq_dev / (n - 1) + 1e-8) if n >= 2 else 1.0  # algos: departure 6
    return (x - mean) * scale * m


# ------------------------------------------------------------ mixed precision, one process
class Precision:
    """fp32 master weights and the copy that computes.

    With `dtype` float32 the master computes itself (`model` is `master`) and every method is
    a no-op. With bf16, `model` is a bf16 copy: the forward, the backward and generation run
    on it (activations, KV cache and gradients in bf16; log-softmax and losses in fp32, as
    token_logprobs and the engine do), while the optimizer, gradient clipping and checkpoints
    use the fp32 `master`: bf16 weights would round most small updates away. After each
    backward `collect_grads` adds the copy's gradients into the master's (in fp32, so
    micro-batches accumulate without bf16 rounding); after each optimizer step `sync` rounds
    the master into the copy. This is FSDP's mixed precision (param_dtype bf16, fp32 shards
    and optimizer) on one process."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype = torch.float32):
        self.master, self.dtype = master, dtype
        self.model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
        self._pairs = ([] if self.model is master
                       else list(zip(master.parameters(), self.model.parameters())))

    def collect_grads(self) -> None:
        for m, c in self._pairs:
            if c.grad is not None:
                m.grad = c.grad.float() if m.grad is None else m.grad.add_(c.grad)
                c.grad = None

    @torch.no_grad()
    def sync(self) -> None:
        for m, c in self._pairs:
            c.copy_(m)


# ---------------------------------------------------------------- the rows over passes
def build_batch(trajs: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors of the rows (env errors left out by the caller): input_ids,
    attention_mask, position_ids, loss_mask, old_logprobs (the sampler's log-prob of token t
    given tokens < t, where loss_mask is 1), turn_ids (each sampled token's turn, from 0;
    else -1); and (B,) rewards (outcomes) and group_ids."""
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    lps = torch.zeros((B, T), dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    pos = torch.arange(T).expand(B, T).clone()
    sampled = mask > 0
    starts = sampled.clone()  # a turn is one run of sampled ids: number the runs' first ids
    starts[:, 1:] &= ~sampled[:, :-1]
    turn_ids = torch.where(sampled, starts.long().cumsum(dim=1) - 1, -1)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group for t in trajs], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": mask,
            "old_logprobs": lps, "turn_ids": turn_ids,
            "rewards": rewards, "group_ids": groups}


def length_buckets(lengths: list[int], max_tokens: int,
                   overhead_tokens: int | None = None) -> list[list[int]]:
    """Split row indices into micro-batches of similar length, each with rows x longest <=
    max_tokens (a row longer than that gets its own batch), minimising padded tokens plus
    `overhead_tokens` per micro-batch (a forward pass has a fixed cost; default
    max_tokens / 16). Rows sorted by length make each batch a contiguous run, so a short
    dynamic programme finds the best cut points."""
    overhead = max_tokens // 16 if overhead_tokens is None else overhead_tokens
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    L = [lengths[i] for i in order]
    n = len(L)
    prefix = [0]
    for x in L:
        prefix.append(prefix[-1] + x)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of batching the j longest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # batch = sorted rows i..j-1; its longest is L[i]
            if L[i] * (j - i) > max_tokens and j - i > 1:
                break
            cost = best[i] + L[i] * (j - i) - (prefix[j] - prefix[i]) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


# off: idle rows are forwarded too, to the same update (tests/test_plain_layers.py)
SKIP_IDLE = True


class Rows:
    """A step's trajectories as a padded batch on the device (torchrun: plus a blank row at
    index B), in micro-batches of similar length, <= --micro-batch-tokens each or one row."""

    def __init__(self, run, trajs: list[Trajectory]):
        self.B, self.max_tokens = len(trajs), run.cfg.micro_batch_tokens
        blank = ([Trajectory("", -1, -1, [], [run.pad, run.pad], [0, 0], [0.0, 0.0])]
                 if world_size() > 1 else [])
        self.trajs = list(trajs) + blank  # the rows, in order
        batch = build_batch(self.trajs, run.pad)
        self.batch = {k: v.to(run.device) for k, v in batch.items()}
        self.lengths = self.batch["attention_mask"].sum(-1).tolist()

    def micro_batches(self, rows: list[int], skip=frozenset()) -> list[list[int]]:
        """`rows` but `skip` (idle rows: nothing to compute, unless SKIP_IDLE is off) in
        length buckets, then blank passes up to the busiest rank's count."""
        rows = [i for i in rows if i not in skip] if SKIP_IDLE else list(rows)
        buckets = [[rows[j] for j in b]
                   for b in length_buckets([self.lengths[i] for i in rows], self.max_tokens)]
        return buckets + [[self.B]] * (all_max(len(buckets)) - len(buckets))

    def cut(self, idx: list[int]) -> tuple[dict, torch.Tensor]:
        """Rows `idx` cut to the longest, t tokens (no column of padding only): algos.INPUTS
        (b, t) and the loss mask (b, t-1), shifted as the log-probs (token j+1's at j)."""
        t = max(self.lengths[i] for i in idx)
        inputs = {k: self.batch[k][idx, :t] for k in algos.INPUTS}
        return inputs, self.batch["loss_mask"][idx, 1:t]

    def passes(self, fn, skip=frozenset()) -> torch.Tensor:
        """fn(rows, mask) -> (b, t-1) on micro-batches `cut` but `skip`, no grad: all rows."""
        out = torch.zeros_like(self.batch["loss_mask"][:, 1:])
        with torch.no_grad():
            for idx in self.micro_batches(list(range(self.B)), skip):
                rows, mask = self.cut(idx)
                out[idx, :mask.shape[1]] = fn(rows, mask)
        return out


def idle_rows(run, adv: torch.Tensor, mask: torch.Tensor, B: int) -> set[int]:
    """Rows that cannot move the weights: every sampled token's advantage is 0 (GRPO, a group
    whose outcomes tie) and the loss has no KL, entropy or value term. Never forwarded, they
    still count in the loss denominators: the update equals one computing them (grad 0)."""
    cfg = run.cfg
    if cfg.kl_coef or cfg.entropy_coef or run.critic is not None:
        return set()
    signal = (adv[:B] * mask[:B]).abs().sum(-1).tolist()  # one pass, not one per row
    return {i for i, x in enumerate(signal) if x == 0}
