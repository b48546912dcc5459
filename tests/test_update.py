"""The update's numerics, each pinned by a test that fails if it breaks: fp32 master weights
whatever the checkpoint's dtype, the trainer's log-probs at the sampling temperature, the signs of
the KL and entropy terms, and the critic's loss weighted across micro-batches like the policy's."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, train_update
from test_distributed import fixed_trajectories

from models import policy
import train
from trainer.setup import update_run
from engines import HFEngine
from models.tiny import build_model


@pytest.fixture(scope="module")
def corridor_folder(tmp_path_factory):
    import models.tiny as tiny_model
    return tiny_model.build(str(tmp_path_factory.mktemp("tiny") / "corridor"),
                            env_names=("corridor",), tokenizer="words", layers=2, hidden=64)


def test_a_bf16_checkpoint_trains_in_fp32(tmp_path, corridor_folder):
    """One step at lr 1e-6 from a model saved in bf16 moves nearly every weight: the trainer keeps
    fp32 master weights (in bf16, most such updates round to nothing: 1.8% of the weights
    moved)."""
    from transformers import AutoModelForCausalLM
    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(corridor_folder).to(torch.bfloat16).save_pretrained(bf16)
    for name in os.listdir(corridor_folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (bf16 / name).write_bytes(open(os.path.join(corridor_folder, name), "rb").read())
    assert json.load(open(bf16 / "config.json"))["dtype"] == "bfloat16"
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--model", str(bf16),
                        "--steps", "1", "--schedule", "2", "--batch-size", "2", "--group-size", "2",
                        "--max-new-tokens", "4", "--lr", "1e-6", "--entropy-coef", "0.01",
                        "--threads", "1", "--eval-every", "0",
                        "--warmup-steps", "0", "--no-dynamic-sampling", "--dtype", "fp32", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    before = AutoModelForCausalLM.from_pretrained(bf16).float().state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "checkpoint" / "model").state_dict()
    moved = sum(int((after[k].float() != before[k]).sum()) for k in before)
    total = sum(v.numel() for v in before.values())
    assert moved / total > 0.9, f"only {moved / total:.1%} of the weights moved"
    # the checkpoint keeps the master weights
    assert all(v.dtype == torch.float32 for v in after.values())


def tiny_run(flags, model, ref=None, critic=None, lr=0.5):
    cfg = train.parse_args(["--env", "corridor", *flags])
    optims = {"policy": torch.optim.SGD(model.parameters(), lr=lr)}
    if critic is not None:
        optims["critic"] = torch.optim.SGD(critic.parameters(), lr=lr)
    return update_run(cfg, model, optims, ref=ref, critic=critic)


def logits_on_sampled(model, trajs) -> torch.Tensor:
    """The model's logits at the positions that predict the rows' sampled tokens: (n, V)."""
    from distributed import build_batch
    batch = build_batch(trajs, 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1]
    return logits[batch["loss_mask"][:, 1:] > 0].float()


def exact_kl(model, ref, trajs) -> float:
    """Mean over sampled positions of KL(pi || pi_ref), summed over the whole vocabulary (no
    estimator)."""
    lp, lq = (logits_on_sampled(model, trajs).log_softmax(-1),
              logits_on_sampled(ref, trajs).log_softmax(-1))
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def entropy(model, trajs) -> float:
    lp = logits_on_sampled(model, trajs).log_softmax(-1)
    return float(-(lp.exp() * lp).sum(-1).mean())


def peaked_model():
    """A tiny model whose next-token distributions are far from uniform (room for the entropy to
    rise)."""
    torch.manual_seed(0)
    model = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def equal_rewards(trajs):
    """The same reward everywhere: every advantage is 0, and only the KL or entropy term moves the
    weights."""
    for t in trajs:
        t.reward = 1.0
    return trajs


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_the_kl_term_pulls_toward_the_reference(kind):
    """k2 and k3 as loss terms lower KL(pi || pi_ref); the sign flipped, they would raise it. (k1's
    expected gradient is zero: algos.kl_penalty.)"""
    ref = peaked_model().eval()
    model = copy.deepcopy(ref)
    with torch.no_grad():  # the policy has drifted from the reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trajs = equal_rewards(fixed_trajectories(model))
    before = exact_kl(model, ref, trajs)
    run = tiny_run(["--kl-coef", "1.0", "--kl-kind", kind], model, ref=ref, lr=0.1)
    # small clipped steps; with the sign flipped the KL triples (0.05 -> 0.13-0.15)
    for _ in range(5):
        train_update(run, trajs)
    after = exact_kl(model, ref, trajs)
    assert after < 0.9 * before, (before, after)


def test_the_entropy_bonus_raises_the_entropy():
    model = peaked_model()
    trajs = equal_rewards(fixed_trajectories(model))
    before = entropy(model, trajs)
    run = tiny_run(["--entropy-coef", "1.0"], model, lr=0.1)
    for _ in range(5):  # 1.84 -> 2.33 nats; with the sign flipped, 1.34
        train_update(run, trajs)
    assert entropy(model, trajs) > before + 0.2, (before, entropy(model, trajs))


def test_the_critic_loss_adds_up_over_micro_batches(tmp_path):
    """PPO's critic gets the same update whether a mini-batch is one micro-batch or one row per
    micro-batch, in every aggregation mode."""
    torch.manual_seed(0)
    model = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    model.save_pretrained(tmp_path / "m")
    trajs = fixed_trajectories(model)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        critics = []
        for micro in ("100000", "1"):
            torch.manual_seed(1)
            m, critic = copy.deepcopy(model), policy.Critic(str(tmp_path / "m"))
            # a critic that already predicts something
            torch.nn.init.normal_(critic.head.weight, std=0.1)
            torch.manual_seed(2)
            train_update(tiny_run(["--algo", "ppo", "--loss-agg", mode,
                                   "--micro-batch-tokens", micro], m, critic=critic, lr=0.1), trajs)
            critics.append(torch.cat([p.detach().flatten() for p in critic.parameters()]))
        assert torch.allclose(critics[0], critics[1], atol=1e-6), (
            mode, (critics[0] - critics[1]).abs().max())


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_trainer_scores_sampled_tokens_at_the_sampling_temperature(temperature):
    """The sampler's log-probs are those of softmax(logits / T); the trainer's must be too (at T = 1
    a trainer that ignored T would pass unnoticed)."""
    torch.manual_seed(0)
    model = build_model(vocab_size=50, layers=2, hidden=32, heads=2).eval()
    prompts = [[1, 5, 7, 9], [2, 3, 4, 5, 6, 8]]
    samples = HFEngine(model, pad_id=0).generate(prompts, 12, [49], temperature, 1.0,
                                                 torch.Generator().manual_seed(0))
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p + s.ids])
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1])[None]}
        with torch.no_grad():
            lp = policy.token_logprobs(model, mb, temperature)[0][0, len(p) - 1:]
            untempered = policy.token_logprobs(model, mb, 1.0)[0][0, len(p) - 1:]
        assert torch.allclose(lp, torch.tensor(s.logprobs), atol=1e-4)
        assert (untempered - torch.tensor(s.logprobs)).abs().max() > 1e-2


def hand_row(ids, mask, reward, group) -> "Trajectory":
    """One finished trajectory of the given ids and loss mask (sampler log-probs 0)."""
    from rollout import Trajectory
    return Trajectory("corridor", group, group, [], list(ids), list(mask), [0.0] * len(ids),
                      turns=1, status="done", reward=reward)


def test_the_last_partial_mini_batch_is_trained_on():
    """3 trajectories, --mini-batch-size 2, 2 epochs: each epoch makes ceil(3 / 2) = 2 optimizer
    steps, the second on the one row left over, so every row is forwarded once an epoch. By hand:
    rows of 7, 9 and 12 tokens (every one with an advantage: no row is idle) -> 4 optimizer steps
    and 2 x 28 = 56 tokens trained on (dropping the partial mini-batch: 2 steps, at most 42)."""
    torch.manual_seed(0)
    model = build_model(vocab_size=50, layers=1, hidden=16, heads=2)
    trajs = [hand_row(range(1, 8), [0, 0, 0, 1, 1, 1, 1], 1.0, 0),
             hand_row(range(1, 10), [0, 0, 0, 1, 1, 0, 0, 1, 1], 0.0, 0),
             hand_row(range(1, 13), [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1], 1.0, 1)]
    run = tiny_run(["--mini-batch-size", "2", "--ppo-epochs", "2", "--kl-coef", "0",
                    "--entropy-coef", "0"], model, lr=0.01)
    steps = []
    run.optims["policy"].register_step_post_hook(lambda *_: steps.append(1))
    m = train_update(run, trajs)
    assert len(steps) == 4 and m["idle_rows"] == 0
    assert m["train_tokens"] == 2 * (7 + 9 + 12)


class LastTokenCritic(torch.nn.Module):
    """A stand-in critic: the value of each prefix is its last token's id / 10, so which token's
    value sits at which position can be read off."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return input_ids.float() * self.scale


def test_the_critics_values_sit_where_the_logits_that_sampled_the_token_are():
    """train.advantages with a critic (PPO): position t of the (B, T-1) tensors holds token t+1's
    mask and V(tokens 0..t), the prefix that token was sampled from; a value read one token late
    leaks the sampled token into its own baseline. By hand, ids 3 5 7 9 11 13, sampled 7 9 and 13
    (11 an observation), outcome 1: V = 0.3 0.5 0.7 0.9 1.1; GAE with gamma 1 and lambda 0 on the
    sampled positions 1, 2, 4: returns r + V(next sampled) = 0.7, 1.1 (the observation skipped),
    1.0; advantages returns - V = 0.2, 0.4, -0.1, whitened."""
    torch.manual_seed(0)
    model = build_model(vocab_size=50, layers=1, hidden=16, heads=2)
    run = tiny_run(["--algo", "ppo", "--gamma", "1", "--lam", "0"], model,
                   critic=LastTokenCritic())
    rows = train.Rows(run, [hand_row([3, 5, 7, 9, 11, 13], [0, 0, 1, 1, 0, 1], 1.0, 0)])
    adv, returns, values = train.advantages(run, rows)
    assert torch.allclose(values, torch.tensor([[0.3, 0.5, 0.7, 0.9, 1.1]]))
    assert torch.allclose(returns, torch.tensor([[0.0, 0.7, 1.1, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.0, 0.132453, 0.927173, 0.0, -1.059626]]),
                          atol=1e-5)
