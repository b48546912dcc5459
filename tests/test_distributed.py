"""train.py under torchrun, on CPU with gloo: ranks play whole groups, the loss weights add up to
the one-process loss, an FSDP2 update on two processes equals the one-process update on the same
trajectories, and a run of two ranks writes one log and a checkpoint that one process resumes."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, train_update

import algos
import models.builtin as models
from models import policy
import train
from trainer import run as run_layer
from trainer.setup import update_run
from rollout import Trajectory


# ---------------------------------------------------------------- pure pieces
def test_ranks_play_whole_groups_in_one_process_order():
    chosen = [7, 3, 9, 5]
    one = run_layer.rank_items(chosen, 4, 3)
    assert one == ([7, 7, 7, 3, 3, 3, 9, 9, 9, 5, 5, 5], [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    for world in (2, 4):
        parts = [run_layer.rank_items(chosen, 4, 3, r, world) for r in range(world)]
        assert sum((p[0] for p in parts), []) == one[0] and sum((p[1] for p in parts), []) == one[1]
        groups = [set(p[1]) for p in parts]
        # no group on two ranks
        assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1:])
    # fewer tasks than batch_size: the list repeats, each slot still its own group
    assert run_layer.rank_items([8, 6], 4, 2, 1, 2) == ([8, 8, 6, 6], [2, 2, 3, 3])
    with pytest.raises(AssertionError):
        run_layer.rank_items(chosen, 3, 2, 0, 2)


def test_batch_size_must_divide_among_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for flags, needle in ((["--batch-size", "3"],
                           "--batch-size 3 must be divisible by the number of processes (2)"),
                          (["--batch-size", "4", "--mini-batch-size", "3"],
                           "--mini-batch-size 3 must be divisible")):
        with pytest.raises(SystemExit):
            train.parse_args(["--env", "corridor", *flags])
        assert needle in capsys.readouterr().err
    assert train.parse_args(["--env", "corridor", "--batch-size", "4",
                             "--mini-batch-size", "2"]).batch_size == 4


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU node with --device auto/cuda: a line naming the fix,
    before NCCL fails deep in init_process_group (it did on a real H100)."""
    from distributed import init_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
                 ("RANK", "1")):
        monkeypatch.setenv(k, v)
    for device in ("auto", "cuda"):
        with pytest.raises(SystemExit, match=r"2 processes on this node but 1 GPU\(s\): "
                                             r"use --nproc-per-node 1 or "
                                             r"less, or --device cpu"):
            init_distributed(device)


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_micro_weights_add_up_to_the_global_loss(mode):
    """Rows spread unevenly over 2 ranks and cut into micro-batches (one rank holding none): the sum
    over ranks of the FSDP-averaged, weighted micro-batch losses is agg_loss over all rows."""
    g = torch.Generator().manual_seed(0)
    loss_mat, mask = torch.randn(9, 6, generator=g), (torch.rand(9, 6, generator=g) < 0.5).float()
    mask[4] = 0  # a row without sampled tokens counts in no denominator
    for ranks in ([[0, 1, 2, 3, 4], [5, 6, 7, 8]], [[0, 1, 2, 3, 4, 5, 6, 7, 8], []]):
        world = len(ranks)
        denominator = sum(algos.agg_denominator(mask[r], mode) for r in ranks)
        total = 0.0
        for r in ranks:
            for micro in (r[:2], r[2:3], r[3:]):
                if micro:
                    w = train.micro_weight(mask[micro], denominator, mode, world)
                    # / world: FSDP
                    total += w / world * float(algos.agg_loss(loss_mat[micro], mask[micro],
                                                              mode))
        assert total == pytest.approx(float(algos.agg_loss(loss_mat, mask, mode)), rel=1e-5)


# ---------------------------------------------------------- an FSDP2 update == a one-process update
def fixed_trajectories(model, n: int = 8, seed: int = 0) -> list[Trajectory]:
    """n multi-turn rows of random ids (groups of 2, uneven lengths), rewarded at random, with
    sampler log-probs = the model's own plus noise (a sampler that differs a little from the
    trainer)."""
    rnd = random.Random(seed)
    trajs = []
    for i in range(n):
        ids = [rnd.randrange(1, 50) for _ in range(rnd.randint(3, 6))]
        mask = [0] * len(ids)
        for _ in range(rnd.randint(1, 3 if i < n // 2 else 6)):  # the second half is longer
            reply = [rnd.randrange(1, 50) for _ in range(rnd.randint(2, 5))]
            obs = [rnd.randrange(1, 50) for _ in range(3)]
            ids, mask = ids + reply + obs, mask + [1] * len(reply) + [0] * len(obs)
        trajs.append(Trajectory("corridor", i // 2, i // 2, [], ids, mask, [0.0] * len(ids),
                                turns=1, status="done", reward=float(rnd.random() < 0.5)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in trajs:
            x = torch.tensor([t.token_ids])
            lp = torch.nn.functional.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
            lp = lp.gather(-1, x[0, 1:, None])[:, 0] + 0.05 * torch.randn(len(t.token_ids) - 1,
                                                                          generator=g)
            t.logprobs = [0.0] + [float(v) if m else 0.0 for v, m in zip(lp, t.loss_mask[1:])]
    return trajs


# (flags, how the 8 rows are split over 2 ranks, whether the result must equal the one-process one)
CASES = [
    (["--algo", "grpo"], 4, True),
    # several micro-batches, a different number per rank
    (["--algo", "grpo", "--loss-agg", "token_mean", "--micro-batch-tokens", "40",
      "--entropy-coef", "0.01", "--kl-coef", "0.1", "--tis-cap", "1.5"], 4, True),
    # global whitening
    (["--algo", "reinforce_pp", "--gamma", "0.9", "--loss-agg", "seq_mean_token_sum"], 4, True),
    (["--algo", "ppo", "--lam", "0.95", "--micro-batch-tokens", "60"], 4, True),  # a sharded critic
    # rank 1 holds no trajectory at all
    (["--algo", "rloo", "--micro-batch-tokens", "60"], 8, True),
    (["--algo", "grpo", "--grad-checkpointing", "--micro-batch-tokens", "60"], 4, True),
    # 3 steps on rank 0, 1 on rank 1
    (["--algo", "grpo", "--mini-batch-size", "2", "--ppo-epochs", "2"], 6, False),
]


def run_update(flags, model_dir, trajs, sharded: bool):
    from transformers import AutoModelForCausalLM

    cfg = train.parse_args(["--env", "corridor", *flags])
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir)  # noqa: E731
    model, ref = load(), load().eval() if cfg.kl_coef > 0 else None
    critic = policy.Critic(model_dir) if cfg.algo == "ppo" else None
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # as train.py: checkpointing is active in training mode only
    if sharded:
        model, ref, critic = (policy.shard_model(m, torch.device("cpu")) if m is not None else None
                              for m in (model, ref, critic))
    optims = {"policy": torch.optim.SGD(model.parameters(), lr=0.5)}
    if critic is not None:
        optims["critic"] = torch.optim.SGD(critic.parameters(), lr=0.5)
    torch.manual_seed(0)
    run = update_run(cfg, model, optims, ref=ref, critic=critic)
    stats = train_update(run, trajs)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def flat(m):  # every rank: whole tensors
        full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
        return torch.cat([v.detach().float().flatten() for _, v in sorted(full.items())])
    return stats, flat(model), None if critic is None else flat(critic)


def _rank_main(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=world)
    trajs = torch.load(os.path.join(tmp, "trajs.pt"), weights_only=False)
    results = []
    for flags, split, _ in CASES:
        mine = trajs[:split] if rank == 0 else trajs[split:]
        stats, params, critic = run_update(flags, os.path.join(tmp, "model"), mine, sharded=True)
        every = [None] * world
        torch.distributed.all_gather_object(every, (params, critic))
        assert all(torch.equal(p, params) for p, _ in every), (
            f"ranks hold different weights after {flags}")
        results.append((stats, params, critic))
    if rank == 0:
        torch.save(results, os.path.join(tmp, "results.pt"))
    # neither rank tears gloo down while the other still talks (an abort, seen in CI)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_fsdp_update_on_two_ranks_equals_one_process(tmp_path):
    """The same fixed trajectories, split over two gloo ranks with FSDP2, give the one-process loss
    and weights (the critic's too): all aggregation modes, micro-batches, global whitening, critic,
    reference KL, TIS, a rank without trajectories, activation checkpointing. Both ranks end with
    identical weights, also when their mini-batch counts differ."""
    from models.tiny import build_model

    model = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    model.save_pretrained(tmp_path / "model")
    trajs = fixed_trajectories(model)
    torch.save(trajs, tmp_path / "trajs.pt")
    torch.multiprocessing.spawn(_rank_main, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    before = torch.cat([v.float().flatten() for _, v in sorted(model.state_dict().items())])
    for (flags, _, comparable), (stats, params, critic) in zip(CASES, results):
        assert (params - before).abs().max() > 1e-4, flags  # the update did something
        if not comparable:
            continue
        one_stats, one_params, one_critic = run_update(flags, tmp_path / "model", trajs,
                                                       sharded=False)
        assert torch.allclose(params, one_params, atol=2e-5, rtol=1e-4), (
            flags, (params - one_params).abs().max())
        # the critic's loss is weighted across micro-batches and ranks like the policy's
        if critic is not None:
            assert torch.allclose(critic, one_critic, atol=2e-5, rtol=1e-4), (
                flags, (critic - one_critic).abs().max())
        terms = (("value_loss",) if "ppo" in flags else ()) + (
            ("kl",) if "--kl-coef" in flags else ())  # with their model only
        for k in ("loss", "entropy", "grad_norm", "logprob_diff", "logprob_kl",
                  "train_tokens") + terms:
            assert stats[k] == pytest.approx(one_stats[k], rel=1e-4, abs=1e-6), (flags, k)


# ---------------------------------------------------------------- torchrun end to end
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cache"))
    models.default_model_path("corridor", path)  # built once here, not by the ranks
    return path


def test_torchrun_two_ranks_then_one_process_resumes(tmp_path, cache_dir):
    out = str(tmp_path / "run")
    common = ["train.py", "--env", "corridor", "--batch-size", "2", "--group-size", "2",
              "--max-new-tokens", "4",
              "--threads", "1", "--schedule", "2,3", "--schedule-every", "1", "--algo", "ppo",
              "--kl-coef", "0.01",
              "--eval-every", "2", "--eval-tasks", "4", "--out", out, "--cache-dir", cache_dir,
              # gloo ranks also where a GPU is (auto would put both ranks on CUDA)
              "--device", "cpu"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    r = subprocess.run([*torchrun, *common, "--steps", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in m] == [1, 2]
    assert all(x["time_sync_s"] == 0.0 and "logprob_kl" in x and "value_loss" in x for x in m)
    # rank 0 writes every rank's trajectories, in the order one process plays them
    for step in (1, 2):
        rows = [json.loads(x)
                for x in open(os.path.join(out, "rollouts", f"step_{step:06d}.jsonl"))]
        assert ([x["group"] for x in rows] == [0, 0, 1, 1]
                and rows[0]["item_id"] == rows[1]["item_id"])
        assert sum(x["status"] in ("done", "max_turns") for x in rows) == 4
    assert not [f for f in os.listdir(os.path.join(out, "rollouts")) if "rank" in f]
    evals = [json.loads(x) for x in open(os.path.join(out, "eval.jsonl"))]
    # both ranks' halves
    assert [e["step"] for e in evals] == [0, 2] and all(e["tasks"] == 4 for e in evals)
    ckpt = os.path.join(out, "checkpoint")
    assert (json.load(open(os.path.join(ckpt, "model", "config.json")))["architectures"]
            == ["LlamaForCausalLM"])
    assert len(torch.load(os.path.join(ckpt, "trainer_state.pt"),
                          weights_only=False)["rank_rngs"]) == 2

    r = subprocess.run([sys.executable, *common, "--steps", "3", "--resume"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming 2 cpu rank(s) as 1 cpu rank(s)" in r.stdout
    m = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in m] == [1, 2, 3] and m[2]["max_turns"] == 3
    assert len(open(os.path.join(out, "rollouts", "step_000003.jsonl")).readlines()) == 4
    optim = torch.load(os.path.join(ckpt, "optim.pt"), weights_only=True)["optims"]
    for name in ("policy", "critic"):  # Adam's step count went on from the two-rank run: 2 + 1
        assert {float(s["step"]) for s in optim[name]["state"].values()} == {3.0}, name


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_across_two_nodes_writes_one_run_folder(tmp_path, cache_dir):
    """docs/gpu.md's multi-node command on one machine: two `torchrun --nnodes 2 --nproc-per-node 1
    --node-rank R` processes meet at rank 0's address (here 127.0.0.1), each rank on an env server
    of its own node; rank 0 (node 0) writes the one run folder: every rank's trajectories, the
    evaluations both halves played, a checkpoint holding both ranks' random streams. Both exit 0."""
    out, port = str(tmp_path / "run"), free_port()
    args = ["train.py", "--env", "corridor", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--threads", "1", "--schedule", "2", "--steps", "2",
            "--eval-every", "2", "--eval-tasks", "2", "--out", out, "--cache-dir", cache_dir,
            "--device", "cpu"]
    procs, logs = [], [tmp_path / f"node{r}.log" for r in (0, 1)]
    try:
        for r in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                 "--master-port", str(port), *args], cwd=ROOT, stdout=open(logs[r], "w"),
                stderr=subprocess.STDOUT, text=True))
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert f"run folder: {out}" in text[0] and "run folder:" not in text[1]  # rank 0 speaks
    m = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in m] == [1, 2]
    for step in (1, 2):  # both ranks' groups, in one process's order
        rows = [json.loads(x)
                for x in open(os.path.join(out, "rollouts", f"step_{step:06d}.jsonl"))]
        assert [x["group"] for x in rows] == [0, 0, 1, 1]
    evals = [json.loads(x) for x in open(os.path.join(out, "eval.jsonl"))]
    assert [(e["step"], e["tasks"]) for e in evals] == [(0, 2), (2, 2)]
    state = torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"), weights_only=False)
    assert state["step"] == 2 and len(state["rank_rngs"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["node0.log", "node1.log", "run"]


def test_the_resume_command_of_a_multi_node_run(monkeypatch):
    from trainer.checkpoints import resume_command

    for k, v in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1"),
                 ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    assert resume_command("runs/a") == ("torchrun --nnodes 2 --nproc-per-node 2 --node-rank R "
                                        "--master-addr 10.0.0.1 --master-port 29500 train.py "
                                        "--resume --out runs/a")
