"""bf16 compute with fp32 master weights (distributed.Precision), --dtype, and the update's
skip of rows without signal: the skip gives the update that computing those rows gives, the bf16
copy's gradients land in the fp32 master without rounding small updates away, and sampler and
trainer agree in bf16."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, train_update
from test_distributed import fixed_trajectories

from models import policy
import train
from distributed import Precision
from trainer.setup import update_run
from engines import HFEngine
from models.tiny import build_model


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(vocab_size=50, layers=2, hidden=32, heads=2)


def run_of(flags, model, optim="adamw", lr=1e-2, dtype=torch.float32, compute_dtype=None):
    """A run for train.update; `compute_dtype` other than `dtype`: FSDP's mixed precision, which
    computes in bf16 while prec stays fp32 (distributed.py)."""
    cfg = train.parse_args(["--env", "corridor", *flags])
    opt = (torch.optim.AdamW if optim == "adamw" else torch.optim.SGD)(model.parameters(), lr=lr)
    return update_run(cfg, model, {"policy": opt}, dtype, compute_dtype=compute_dtype or dtype)


def tied_groups(trajs, groups=(0, 1)):
    """Every trajectory of these groups scores the same: their GRPO advantages are all 0."""
    for t in trajs:
        if t.group in groups:
            t.reward = 1.0
    return trajs


@pytest.mark.parametrize("flags", [[], ["--mini-batch-size", "2", "--ppo-epochs", "2"],
                                   ["--loss-agg", "token_mean", "--mini-batch-size", "4"]])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_rows_without_signal_are_skipped_with_the_same_update(flags, optim, monkeypatch):
    """Groups 0 and 1 tie (4 of 8 rows without signal). The update that never forwards them equals
    the one that computes them over 3 steps, and forwards half the rows. With SGD to float
    precision; with AdamW too (a mini-batch of idle rows alone still steps the optimizer, as a zero
    gradient would), within 1e-4 of weights that move by 3e-2: Adam divides by the gradients' own
    size, which magnifies the last-bit differences of summing the other rows in other
    micro-batches."""
    base = tiny()
    trajs = tied_groups(fixed_trajectories(base))
    forwarded = {"skip": 0, "all": 0}
    real_micro_step = train.micro_step
    results = {}
    for mode in ("skip", "all"):
        model = copy.deepcopy(base)
        run = run_of(flags, model, optim=optim)
        if mode == "all":
            monkeypatch.setattr(train, "idle_rows", lambda *a: set())

        def counting(run_, rows, targets, idx, *a, _mode=mode, **kw):
            forwarded[_mode] += len(idx)
            return real_micro_step(run_, rows, targets, idx, *a, **kw)

        monkeypatch.setattr(train, "micro_step", counting)
        torch.manual_seed(1)
        metrics = [train_update(run, trajs) for _ in range(3)]
        monkeypatch.undo()
        results[mode] = (model, metrics)
    (skip_model, skip_metrics), (all_model, _) = results["skip"], results["all"]
    assert skip_metrics[0]["idle_rows"] == 4
    assert forwarded["skip"] == forwarded["all"] // 2
    for a, b in zip(skip_model.parameters(), all_model.parameters()):
        assert torch.allclose(a, b, atol=1e-7 if optim == "sgd" else 1e-4, rtol=0)
    assert any((a != b).any() for a, b in zip(skip_model.parameters(), base.parameters()))


@pytest.mark.parametrize("kind,dtype,flags,recomputed", [
    ("hf", torch.float32, [], False), ("vllm", torch.float32, [], False),  # the same numbers
    ("hf", torch.float32, ["--top-p", "0.9"], False),  # HF records the untruncated log-prob
    ("vllm", torch.float32, ["--top-p", "0.9"], True),  # vLLM's is the renormalised nucleus's
    ("hf", torch.bfloat16, [], True), ("vllm", torch.bfloat16, [], True),  # bf16 rounds apart
    ("hf", "fsdp-bf16", [], True),  # under torchrun: prec fp32, FSDP computes in bf16
    ("hf", torch.float32, ["--tis-cap", "2"], True)])
def test_old_logprobs_are_recomputed_only_where_sampler_and_trainer_differ(kind, dtype, flags,
                                                                            recomputed,
                                                                            monkeypatch):
    """The update's extra forward over the rows (the PPO ratio's denominator from the trainer)
    runs where the sampler's log-probs are not the trainer's numbers: bf16 (FSDP's too), vLLM
    with top_p < 1, --tis-cap; in fp32 vLLM's log-probs are the trainer's to 3.4e-6 a token
    (bench/sampler_gap.py)."""
    base = tiny()
    run = (run_of(flags, copy.deepcopy(base), compute_dtype=torch.bfloat16) if dtype == "fsdp-bf16"
           else run_of(flags, copy.deepcopy(base), dtype=dtype))
    run.engine_kind = kind
    passes = []
    real = train.Rows.passes
    monkeypatch.setattr(train.Rows, "passes", lambda self, fn, skip=frozenset():
                        passes.append(1) or real(self, fn, skip))
    train_update(run, fixed_trajectories(base))
    assert bool(passes) == recomputed


def test_no_rows_are_skipped_when_a_loss_term_reads_them():
    """With a KL or entropy term, a row without advantage still has a gradient: nothing is
    skipped."""
    trajs = tied_groups(fixed_trajectories(tiny()))
    run = run_of(["--entropy-coef", "0.01"], tiny())
    assert train_update(run, trajs)["idle_rows"] == 0
    run = run_of([], tiny())
    assert train_update(run, trajs)["idle_rows"] == 4


def test_bf16_gradients_reach_the_fp32_master_without_rounding_the_update_away():
    """The bf16 copy computes; its gradients are added into the master's in fp32 micro-batch by
    micro-batch; a small step moves nearly every master weight (a bf16 weight would round it away),
    and the copy follows the master after sync."""
    master = tiny()
    prec = Precision(master, torch.bfloat16)
    assert prec.model is not master and next(prec.model.parameters()).dtype == torch.bfloat16
    assert next(master.parameters()).dtype == torch.float32
    ids = torch.randint(1, 50, (2, 12))
    for _ in range(2):  # two micro-batches accumulate
        prec.model(input_ids=ids, labels=ids).loss.backward()
        prec.collect_grads()
    assert all(p.grad is None for p in prec.model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in master.parameters())
    before = [p.detach().clone() for p in master.parameters()]
    torch.optim.AdamW(master.parameters(), lr=1e-6).step()
    prec.sync()
    moved = sum(int((p != b).sum()) for p, b in zip(master.parameters(), before))
    assert moved / sum(b.numel() for b in before) > 0.9
    for p, c in zip(master.parameters(), prec.model.parameters()):
        assert torch.equal(p.to(torch.bfloat16), c)
    assert Precision(master).model is master  # fp32: the master computes


def test_dtype_auto_is_bf16_only_where_it_pays(monkeypatch):
    model = tiny()  # far below MIN_BF16_PARAMS
    assert policy.resolve_dtype("bf16", "cpu", model) == torch.bfloat16
    assert policy.resolve_dtype("fp32", "cpu") == torch.float32
    assert policy.resolve_dtype("auto", "cpu", model) == torch.float32
    monkeypatch.setattr(policy, "MIN_BF16_PARAMS", 0)
    monkeypatch.setattr(policy, "cpu_has_bf16", lambda: True)
    assert policy.resolve_dtype("auto", "cpu", model) == torch.bfloat16
    monkeypatch.setattr(policy, "cpu_has_bf16", lambda: False)
    assert policy.resolve_dtype("auto", "cpu", model) == torch.float32
    with pytest.raises(ValueError):
        policy.resolve_dtype("fp16", "cpu")


def test_bf16_sampler_and_trainer_agree_on_the_tiny_model():
    """The engine samples with the bf16 copy and the trainer scores with it: the log-probs agree
    within bf16's resolution (the same weights and arithmetic; cached decoding and a whole-row
    forward round differently), and the rows' ids are exactly what was sampled."""
    prec = Precision(tiny(), torch.bfloat16)
    prompts = [[1, 5, 7, 9], [3, 4, 11, 12, 13, 2]]
    samples = HFEngine(prec.model, 0).generate(prompts, 10, [], 1.0, 1.0,
                                               torch.Generator().manual_seed(0))
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p + s.ids])
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1])[None]}
        with torch.no_grad():
            lp = policy.token_logprobs(prec.model, mb, 1.0)[0][0, len(p) - 1:]
        assert len(s.ids) == 10 and (lp - torch.tensor(s.logprobs)).abs().max() < 0.05


def test_train_py_runs_in_bf16_with_fp32_checkpoints(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--dtype", "bf16",
                        "--steps", "2", "--schedule", "2", "--batch-size", "2", "--group-size", "4",
                        "--max-new-tokens", "4", "--threads", "1", "--eval-every", "0",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["logprob_diff"] < 0.05 for r in rows if r.get("train_tokens"))
    from transformers import AutoModelForCausalLM
    after = AutoModelForCausalLM.from_pretrained(out / "checkpoint" / "model")
    assert all(p.dtype == torch.float32 for p in after.parameters())
    assert json.load(open(out / "config.json"))["dtype"] == "bf16"


@pytest.mark.parametrize("script", ["train", "eval", "recipes.sft"])
def test_the_scripts_let_idle_openmp_threads_sleep(script):
    """OMP_WAIT_POLICY=PASSIVE is set before torch loads OpenMP (on shared cores, spinning threads
    made a tiny model's update 6x slower); a value the user set is kept."""
    code = f"import os, {script}; print(os.environ['OMP_WAIT_POLICY'])"  # before torch
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert got.stdout.strip() == "PASSIVE", got.stderr[-1000:]
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "ACTIVE"
