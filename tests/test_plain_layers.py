"""The update's layers change speed, never the numbers: with each swapped for its plain version
(every row forwarded even where its advantages are all 0, one row per pass instead of length
buckets), an update on the same trajectories gives the same weights and loss in fp32, to 1e-6
relative. Not to the bit: another grouping of rows into passes sums the gradient in another order
(float addition is not associative). The samplers' side (the HF engine's speed-ups on against
off: the same samples) is tests/test_fast_hf.py's. And a whole Corridor run's two steps with
every boundary plain at once (sampler, env pool, update batching): the same trajectories, the
same update to float rounding."""

import copy
import json
import random

import pytest
import safetensors.torch
import torch

import distributed
import train
import trainer.run
from models.tiny import build_model
from rollout import Trajectory
from trainer.setup import update_run


def trajectories(seed: int = 0) -> list[Trajectory]:
    """Four groups of four rows of 10-60 tokens, sampled tokens in two turns; groups 0 and 2 tie
    (every advantage 0: idle rows), groups 1 and 3 do not."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        for i in range(4):
            n = rng.randint(10, 60)
            ids = [rng.randrange(1, 50) for _ in range(n)]
            mask = [0] * 4 + [1] * (n // 3) + [0] * 3 + [1] * (n - 7 - n // 3)
            lps = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
            reward = 1.0 if g in (0, 2) else float(i % 2)
            out.append(Trajectory("corridor", g, g, [], ids, mask, lps, turns=2, status="done",
                                  reward=reward))
    return out


def one_update(model):
    cfg = train.parse_args(["--env", "corridor", "--micro-batch-tokens", "160",
                            "--mini-batch-size", "8", "--ppo-epochs", "2", "--dtype", "fp32"])
    optims = {"policy": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    run = update_run(cfg, model, optims)
    rows = train.Rows(run, trajectories())
    return train.update(run, rows, *train.advantages(run, rows))


def test_plain_layers_give_the_same_update(monkeypatch):
    torch.manual_seed(0)
    start = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    fast_model, plain_model = copy.deepcopy(start), copy.deepcopy(start)
    fast = one_update(fast_model)
    assert fast["idle_rows"] == 8 and fast["padding_share"] > 0  # both layers acted
    monkeypatch.setattr(distributed, "SKIP_IDLE", False)  # every row forwarded
    monkeypatch.setattr(distributed, "length_buckets",  # one row per pass, no padding
                        lambda lengths, max_tokens: [[i] for i in range(len(lengths))])
    plain = one_update(plain_model)
    assert plain["padding_share"] == 0
    for key in ("loss", "grad_norm", "update_kl"):  # the entropy: of the rows forwarded
        assert plain[key] == pytest.approx(fast[key], rel=1e-6, abs=1e-9), key
    moved = max(float((a - s).abs().max())
                for a, s in zip(fast_model.parameters(), start.parameters()))
    gap = max(float((a - b).abs().max())
              for a, b in zip(fast_model.parameters(), plain_model.parameters()))
    assert moved > 1e-4 and gap < 1e-6 * max(1.0, moved) * 10, (moved, gap)


def test_the_update_statistics_do_not_depend_on_the_passes(monkeypatch):
    """The clipping statistics are per sampled token: one row per pass or length buckets, the
    same clip_frac and approx_kl (they were means over passes: a pass of one short row counted as
    much as one of eight long ones)."""
    torch.manual_seed(0)
    start = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    bucketed = one_update(copy.deepcopy(start))
    monkeypatch.setattr(distributed, "length_buckets",
                        lambda lengths, max_tokens: [[i] for i in range(len(lengths))])
    alone = one_update(copy.deepcopy(start))
    assert bucketed["clip_frac"] > 0
    for key in ("clip_frac", "approx_kl"):
        assert alone[key] == pytest.approx(bucketed[key], rel=1e-6, abs=1e-9), key


def train_run(flags: list[str], out):
    """train.py with `flags` into `out`, the thread count it sets put back after."""
    threads = torch.get_num_threads()
    try:
        train.main(train.parse_args([*flags, "--out", str(out)]))
    finally:
        torch.set_num_threads(threads)
    return out


CORRIDOR = ["--env", "corridor", "--schedule", "8", "--steps", "2", "--batch-size", "8",
            "--group-size", "8", "--max-new-tokens", "4", "--lr", "1e-3", "--eval-every", "0",
            "--threads", "1", "--dtype", "fp32"]


def corridor_steps(out, cache) -> tuple:
    """Two steps of the README's Corridor command in fp32: (metrics, rollouts, final weights)."""
    train_run([*CORRIDOR, "--cache-dir", str(cache)], out)
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    rows = [[json.loads(x) for x in open(out / "rollouts" / f"step_{s:06d}.jsonl")]
            for s in (1, 2)]
    weights = safetensors.torch.load_file(str(out / "checkpoint" / "model" / "model.safetensors"))
    return metrics, rows, weights


@pytest.fixture(scope="module")
def fast_corridor(tmp_path_factory):
    base = tmp_path_factory.mktemp("corridor")
    return corridor_steps(base / "fast", base / "cache"), base / "cache"


def plain_engine(monkeypatch):  # no static cache kept across turns, no compaction
    from hf_engine import HFEngine
    import trainer.setup
    monkeypatch.setattr(trainer.setup, "engine_for", lambda cfg, model, path, pad, *a: HFEngine(
        model, pad, static_cache=False, compact=False))


def plain_pool(monkeypatch):  # one request per instance, no /batch
    from env_client import EnvPool
    import trainer.setup
    monkeypatch.setattr(trainer.setup, "env_pool", lambda url, size, timeout: EnvPool(
        url, size, timeout=timeout, use_batch=False))


def plain_batching(monkeypatch):  # every row forwarded, one row per pass
    monkeypatch.setattr(distributed, "SKIP_IDLE", False)
    monkeypatch.setattr(distributed, "length_buckets",
                        lambda lengths, max_tokens: [[i] for i in range(len(lengths))])


PLAIN = {"engine": [plain_engine], "pool": [plain_pool], "batching": [plain_batching],
         "all": [plain_engine, plain_pool, plain_batching]}


@pytest.mark.parametrize("plain", sorted(PLAIN))
def test_a_corridor_step_with_a_plain_boundary_trains_the_same(plain, fast_corridor, tmp_path,
                                                                monkeypatch):
    """Two steps of the README's Corridor command (both train: 8 groups of 8 at chance level never
    all tie) with the fast layers, then with a boundary plain, or all at once: the sampler (a
    growing cache, every row decoded to the end), the env pool (one request per instance), the
    update's batching (every row forwarded, one row per pass). The same trajectories, token for
    token, the same rewards. With the plain pool alone, every number the same to the bit: the
    same computation. Else the update's numbers equal to 1e-5 relative and the trained weights to
    1e-5: float rounding, not another computation (the sampler's log-probs, the PPO ratio's
    denominator, differ between a static and a growing cache by about 1e-7; another grouping of
    rows sums the gradient in another order)."""
    fast, cache = fast_corridor
    for swap in PLAIN[plain]:
        swap(monkeypatch)
    other = corridor_steps(tmp_path / plain, cache)
    assert all(m["groups_informative"] > 0 and not m["skipped_update"] for m in fast[0])
    for a, b in zip(fast[1], other[1]):
        assert [(t["token_ids"], t["loss_mask"], t["reward"], t["status"]) for t in a] == \
               [(t["token_ids"], t["loss_mask"], t["reward"], t["status"]) for t in b]
    if plain == "pool":
        def untimed(metrics):
            return [{k: v for k, v in m.items() if not k.startswith(("time_", "tokens_per_s"))}
                    for m in metrics]
        assert untimed(fast[0]) == untimed(other[0])
        assert all(torch.equal(v, other[2][k]) for k, v in fast[2].items())
        return
    for a, b in zip(fast[0], other[0]):
        for key in ("grad_norm", "update_kl", "success_rate"):  # (not train_tokens: work done)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (a["step"], key)
        # GRPO's loss at a ratio of 1 is a sum of advantages near 0: compared absolutely
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    # The weights: Adam divides each gradient by its own running size, so a weight whose gradient
    # is near 0 moves by up to lr whatever that gradient's scale, and rounding in it moves the
    # weight (seen: at most 1.5e-5, the plain engine). Bounded at 1e-4 for any one weight, 5% of
    # the 2e-3 two Adam steps at lr 1e-3 may move one, and at 1e-7 on average: no weight moved
    # by another computation.
    for k, v in fast[2].items():
        diff = (v - other[2][k]).abs()
        assert diff.max() < 1e-4 and diff.mean() < 1e-7, (k, float(diff.max()), float(diff.mean()))


def test_a_plain_run_layer_trains_the_same(tmp_path, monkeypatch):
    """The run layer at its plainest: the steps a bare range (no evaluation, checkpoint, env-error
    rule or signal between them), the critical section a bare block, the metrics line appended.
    Two steps of the README's Corridor command, the real layer evaluating and saving after each:
    the same trajectories and every metric of the step the same, to the bit (the layer draws on
    no generator the step uses)."""
    import contextlib
    import os
    import time

    flags = ["--env", "corridor", "--schedule", "8", "--steps", "2", "--batch-size", "8",
             "--group-size", "8", "--max-new-tokens", "4", "--lr", "1e-3", "--eval-every", "1",
             "--eval-samples", "2", "--save-every", "1", "--threads", "1",
             "--cache-dir", str(tmp_path / "cache")]

    def run(name):
        out = train_run(flags, tmp_path / name)
        timed = ("time_", "tokens_per_s", "first_error")
        metrics = [{k: v for k, v in json.loads(x).items() if not k.startswith(timed)}
                   for x in open(out / "metrics.jsonl")]
        rows = [open(out / "rollouts" / f"step_{s:06d}.jsonl").read() for s in (1, 2)]
        return metrics, rows, os.path.exists(out / "eval.jsonl")

    real = run("real")

    def steps(self):
        self.t_start = time.time()
        yield from range(1, self.cfg.steps + 1)

    def log(self, step: int, m: dict) -> None:
        m.update(step=step, skipped_update=int("loss" not in m))
        m.pop("bad")
        with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        self.last = m

    monkeypatch.setattr(trainer.run.Run, "steps", steps)
    monkeypatch.setattr(trainer.run.Run, "critical", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(trainer.run.Run, "log", log)
    plain = run("plain")
    assert real[2] and not plain[2]  # the real layer evaluated between the steps; the plain not
    assert all(m["groups_informative"] > 0 and not m["skipped_update"] for m in real[0])
    assert real[1] == plain[1]
    assert real[0] == plain[0]
