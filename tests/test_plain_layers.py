"""The update's layers change speed, never the numbers: with each swapped for its plain version
(every row forwarded even where its advantages are all 0, one row per pass instead of length
buckets), an update on the same trajectories gives the same weights and loss in fp32, to 1e-6
relative. Not to the bit: another grouping of rows into passes sums the gradient in another order
(float addition is not associative). The samplers' side (the HF engine's speed-ups on against
off: the same samples) is tests/test_fast_hf.py's."""

import copy
import random

import pytest
import torch

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
    rows = train.layer.Rows(run, trajectories())
    return train.update(run, rows, *train.advantages(run, rows))


def test_plain_layers_give_the_same_update(monkeypatch):
    torch.manual_seed(0)
    start = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    fast_model, plain_model = copy.deepcopy(start), copy.deepcopy(start)
    fast = one_update(fast_model)
    assert fast["idle_rows"] == 8 and fast["padding_share"] > 0  # both layers acted
    monkeypatch.setattr(trainer.run, "SKIP_IDLE", False)  # every row forwarded
    monkeypatch.setattr(trainer.run, "length_buckets",  # one row per pass, no padding
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
    monkeypatch.setattr(trainer.run, "length_buckets",
                        lambda lengths, max_tokens: [[i] for i in range(len(lengths))])
    alone = one_update(copy.deepcopy(start))
    assert bucketed["clip_frac"] > 0
    for key in ("clip_frac", "approx_kl"):
        assert alone[key] == pytest.approx(bucketed[key], rel=1e-6, abs=1e-9), key
