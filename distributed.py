"""torchrun plumbing for train.py: the process group, small collectives, which rows each rank
plays, and `Precision`, FSDP's mixed precision on one process (bf16 compute, fp32 masters).

With one process every helper is a no-op (world size 1): train.py reads the same either way.
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
