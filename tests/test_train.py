"""train.py end to end: every --algo runs as a subprocess, a resumed run continues exactly, bad
flags are named, and a tiny model learns the Corridor game with GRPO and with PPO."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, exit_of, train_update

import models.builtin as models
from models import policy
import algos
import train
from hf_engine import HFEngine
from trainer import run as run_layer
from trainer.setup import update_run
from models import warmstart
from tasks import spread

TINY = ["--env", "corridor", "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4",
        "--threads", "1", "--eval-every", "0"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tiny model for the whole module (built on first use)."""
    return str(tmp_path_factory.mktemp("cache"))


def run_train(args, cache_dir, check=True):
    out = subprocess.run([sys.executable, "train.py", *args, "--cache-dir", cache_dir], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


@pytest.mark.parametrize("algo,extra", [
    ("grpo", ["--kl-coef", "0.01", "--entropy-coef", "0.001"]),
    ("rloo", ["--ppo-epochs", "2", "--mini-batch-size", "2"]),
    # tempered log-probs
    ("reinforce_pp", ["--gamma", "0.99", "--loss-agg", "token_mean", "--temperature", "0.7"]),
    ("ppo", ["--lam", "0.95", "--dual-clip", "3", "--lr-decay", "cosine"]),
    # step-level credit, wired end to end
    ("gigpo", ["--gamma", "0.95", "--step-adv-weight", "0.5"]),
])
def test_each_algo_runs_two_steps(tmp_path, cache_dir, algo, extra):
    out = str(tmp_path / "run")
    shown = run_train([*TINY, "--algo", algo, "--steps", "2", "--schedule", "2,3", "--out", out,
                       *extra], cache_dir).stderr
    # the progress bar says what the step is doing: its rollout's turn, then the update
    assert ("rollout turn 1/2" in shown and "rollout turn 3/3" in shown
            and "update of 4 trajectories" in shown)
    m = metrics(out)
    assert [x["step"] for x in m] == [1, 2] and [x["max_turns"] for x in m] == [2, 3]
    assert ("kl" in m[-1]) == ("--kl-coef" in extra)  # a KL term with a reference model only
    for key in ("reward_mean", "success_rate", "turns_mean", "status_done", "loss", "entropy",
                "grad_norm",
                "tokens_per_s", "time_rollout_s", "time_update_s", "padding_share", "logprob_diff"):
        assert key in m[-1], key
    # the trainer scores sampled tokens as the sampler did (None: every row idle, none scored)
    assert all(x["logprob_diff"] < 1e-4 for x in m if x["logprob_diff"] is not None)
    if algo == "ppo":
        assert "value_loss" in m[-1]
        # cosine from --lr down to --lr/steps
        assert [x["lr"] for x in m] == pytest.approx([3e-4, 1.5e-4])
    else:
        assert [x["lr"] for x in m] == pytest.approx([3e-4, 3e-4])
    for step in (1, 2):
        with open(os.path.join(out, "rollouts", f"step_{step:06d}.jsonl")) as f:
            rows = [json.loads(x) for x in f]
        assert len(rows) == 4 and all(r["status"] in ("done", "max_turns") for r in rows)
    assert os.path.exists(os.path.join(out, "checkpoint", "model", "config.json"))
    assert os.path.exists(os.path.join(out, "checkpoint", "trainer_state.pt"))
    assert json.load(open(os.path.join(out, "config.json")))["algo"] == algo


def test_resume_continues_exactly(tmp_path, cache_dir):
    """3 steps straight == 2 steps, then --resume --steps 3: same tasks, samples, losses, horizon.
    The weights move at every step (a resume that lost them would show), and nothing here hangs
    on --steps (not --lr-decay: an extension may change its rates; the next test stops a run)."""
    common = [*TINY, "--schedule", "2,4", "--schedule-every", "2", "--algo", "ppo"]
    run_train([*common, "--steps", "3", "--out", str(tmp_path / "a")], cache_dir)
    run_train([*common, "--steps", "2", "--out", str(tmp_path / "b")], cache_dir)
    run_train([*common, "--steps", "3", "--out", str(tmp_path / "b"), "--resume"], cache_dir)
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [x["step"] for x in b] == [1, 2, 3]
    assert any(x.get("update_kl") for x in a[:2]), a  # the resumed weights had moved
    drop = ("time_rollout_s", "time_update_s", "tokens_per_s")
    strip = lambda d: {k: v for k, v in d.items() if k not in drop}  # noqa: E731
    assert strip(a[2]) == strip(b[2])
    assert a[2]["max_turns"] == 4
    same = lambda p: open(p).read()  # noqa: E731
    assert (same(tmp_path / "a" / "rollouts" / "step_000003.jsonl")
            == same(tmp_path / "b" / "rollouts" / "step_000003.jsonl"))


def test_a_run_stopped_by_an_exception_resumes_exactly_with_a_decaying_rate(tmp_path, cache_dir,
                                                                           monkeypatch):
    """--lr-decay linear over 3 steps; an exception at step 3's rollout saves step 2, and the
    resumed run's step 3 is the straight run's: samples, losses, rates, weights moved."""
    common = [*TINY, "--schedule", "2", "--algo", "grpo", "--lr-decay", "linear", "--steps", "3",
              "--batch-size", "4", "--group-size", "4", "--cache-dir", cache_dir]
    calls, real = [], train.rollout

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in step 3's rollout")
        return real(*a, **k)

    monkeypatch.setattr(train, "rollout", failing)
    with pytest.raises(RuntimeError):
        train.main(train.parse_args([*common, "--out", str(tmp_path / "b")]))
    monkeypatch.setattr(train, "rollout", real)
    train.main(train.parse_args(["--resume", "--out", str(tmp_path / "b"), "--threads", "1",
                                 "--cache-dir", cache_dir]))
    train.main(train.parse_args([*common, "--out", str(tmp_path / "a")]))
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    drop = ("time_rollout_s", "time_update_s", "tokens_per_s", "time_sync_s")
    strip = lambda d: {k: v for k, v in d.items() if k not in drop}  # noqa: E731
    assert [strip(x) for x in a] == [strip(x) for x in b]
    assert any(x.get("update_kl") for x in a[:2]) and a[2]["lr"] < a[1]["lr"] < a[0]["lr"]
    for step in (2, 3):
        name = f"rollouts/step_{step:06d}.jsonl"
        assert open(tmp_path / "a" / name).read() == open(tmp_path / "b" / name).read()


def test_a_longer_resume_keeps_the_stages_the_run_began_with(tmp_path, cache_dir):
    """--schedule 2,4 over --steps 2 is stages of one step each; resumed with --steps 4 the run
    keeps them (not stages of two, from the new --steps), while --lr-decay follows the new --steps;
    a --schedule-every that differs from the checkpoint's is refused in one line."""
    common = [*TINY, "--schedule", "2,4", "--lr", "1e-3", "--lr-decay", "linear"]
    out = tmp_path / "a"
    run_train([*common, "--steps", "2", "--out", str(out)], cache_dir)
    run_train([*common, "--steps", "4", "--out", str(out), "--resume"], cache_dir)
    assert [x["max_turns"] for x in metrics(out)] == [2, 4, 4, 4]
    # 1 - (step - 1) / steps: steps 1-2 of 2, then 3-4 of 4
    assert [x["lr"] for x in metrics(out)] == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4])
    r = run_train([*common, "--steps", "5", "--schedule-every", "3", "--out", str(out),
                   "--resume"], cache_dir, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--resume: checkpoint schedule" in r.stderr.strip().splitlines()[-1]


def test_a_resume_in_another_dtype_says_so(tmp_path, cache_dir):
    """The checkpoint records the dtype the run computed in; a resume that resolves another one
    (--dtype auto on other hardware, or a flag) says so in one line, and summary.json records it."""
    out = str(tmp_path / "a")
    run_train([*TINY, "--steps", "1", "--dtype", "fp32", "--out", out], cache_dir)
    assert json.load(open(os.path.join(out, "summary.json")))["dtype"] == "float32"
    r = run_train([*TINY, "--steps", "2", "--dtype", "bf16", "--out", out, "--resume"], cache_dir)
    assert "resuming a float32 run in bfloat16 (--dtype bf16 here)" in r.stdout, r.stdout[-2000:]
    assert json.load(open(os.path.join(out, "summary.json")))["dtype"] == "bfloat16"
    r = run_train([*TINY, "--steps", "3", "--out", out, "--resume"], cache_dir)  # bf16 again
    assert "resuming a " not in r.stdout


def test_bad_flags_are_named(tmp_path, cache_dir, capsys):
    """Each bad flag is refused by train.parse_args, naming it (exit 2); the first as the user
    sees it, train.py's exit code and its stderr, the rest in this process (the same checks)."""
    out = run_train(["--steps", "0"], cache_dir, check=False)
    assert out.returncode == 2 and "--steps must be at least 1" in out.stderr, out.stderr[-500:]
    for args, needle in [(["--steps", "0"], "--steps must be at least 1"),
                         (["--schedule", "10,0"], "--schedule"),
                         (["--resume"], "--resume needs --out"),
                         (["--resume", "--out", str(tmp_path / "none")],
                          "--resume: no checkpoint in"),
                         (["--dual-clip", "0.5"], "--dual-clip must be greater than 1"),
                         (["--eval-every", "-1"], "--eval-every must be 0 or more"),
                         (["--save-every", "-2"], "--save-every must be -1"),
                         (["--eval-turns", "0"], "--eval-turns must be at least 1"),
                         (["--schedule-kind", "plateau", "--schedule-every", "5"],
                          "--schedule-every is the step schedule's stage length")]:
        code, _, err = exit_of(lambda: train.parse_args([*args, "--cache-dir", cache_dir]), capsys)
        assert code == 2 and needle in err, (args, err[-500:])


def test_lr_decay_falls_from_lr_to_lr_divided_by_steps():
    for steps in (1, 2, 15):
        assert [train.lr_at(s, steps, "none") for s in range(1, steps + 1)] == [1.0] * steps
        for decay in ("linear", "cosine"):
            shares = [train.lr_at(s, steps, decay) for s in range(1, steps + 1)]
            assert shares[0] == 1.0 and shares[-1] == pytest.approx(1 / steps)
            assert all(a > b for a, b in zip(shares, shares[1:]))
    # the cosine holds the rate higher early and lower late than the straight line
    assert train.lr_at(4, 15, "cosine") > train.lr_at(4, 15, "linear")
    assert train.lr_at(12, 15, "cosine") < train.lr_at(12, 15, "linear")
    cfg = train.config.Config(lr=1e-3, critic_lr=1e-4, steps=4, lr_decay="linear")
    optims = {name: torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
              for name in ("policy", "critic")}
    assert (train.set_lr(SimpleNamespace(cfg=cfg, optims=optims, lr_scale=1.0), 3)
            == pytest.approx(5e-4))
    assert optims["critic"].param_groups[0]["lr"] == pytest.approx(5e-5)
    # the --max-update-kl guard's scale multiplies it
    assert (train.set_lr(SimpleNamespace(cfg=cfg, optims=optims, lr_scale=0.5), 3)
            == pytest.approx(2.5e-4))


def test_warmup_rises_to_the_rate_then_follows_the_decay():
    assert ([train.lr_at(s, 10, "none", warmup=3) for s in range(1, 6)]
            == [0.25, 0.5, 0.75, 1.0, 1.0])
    assert (train.lr_at(2, 10, "cosine", warmup=3)
            == pytest.approx(0.5 * train.lr_at(2, 10, "cosine")))
    assert [train.lr_at(s, 4, "none", warmup=0) for s in range(1, 5)] == [1.0] * 4


def test_uses_a_running_env_server(tmp_path, cache_dir):
    from env_server.app import ServerProcess
    with ServerProcess("corridor") as server:
        run_train([*TINY, "--steps", "1", "--schedule", "2", "--env-addr", server.url,
                   "--out", str(tmp_path / "r")],
                  cache_dir)
    assert metrics(tmp_path / "r")[0]["step"] == 1


def test_the_readme_corridor_command_learns_the_game_far_above_chance(tmp_path, cache_dir):
    """The README's Corridor command, seed 0, from the warm start that only clones a random mover:
    held-out success (12 test tasks x 16 samples at K = 8, goals 3 cells away, a distance no
    training task starts at) must end at 80% or more and at least 40 points above chance (a
    random policy on the same tasks and K: 28.9% exactly, a random walk). Why 40 points: at
    chance the 192 held-out episodes would score 28.9% +- 3.3 (one standard error), so 40 points
    above is 12 standard errors: no policy that ignores the observation gets there. The start
    must be near chance (within 20 points: the warm start teaches the form of a move, not the
    game), and the training success of the last 5 steps at least 90% (bench/corridor_seeds.py
    holds seeds 0-4 to the same)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from corridor_seeds import COMMAND
    summary = train.main(train.parse_args([*COMMAND, "--seed", "0", "--threads", "1",
                                           "--out", str(tmp_path / "c"), "--cache-dir",
                                           cache_dir]))
    with open(tmp_path / "c" / "eval.jsonl") as f:
        evals = [json.loads(x) for x in f]
    assert evals[0]["tasks"] == 12 and evals[0]["samples"] == 16
    assert set(evals[0]["by_category"]) == {"distance_3"}  # a game no training task plays
    chance = summary["eval_chance"]
    assert abs(chance - 0.2890625) < 0.1, chance  # 384 random episodes: 4 standard errors
    assert abs(summary["eval_success_start"] - chance) < 0.2, summary
    assert summary["eval_success_end"] >= 0.8, summary
    assert summary["eval_success_end"] - chance >= 0.4, summary
    assert summary["train_success_last"] >= 0.9, summary


def test_rollout_metrics_count_episodes_that_open_with_a_guess():
    from env_server.agents import GUESS_THOUGHT, opening_messages, react_reply
    from rollout import Trajectory
    trajs = []
    for thought in (GUESS_THOUGHT, None, GUESS_THOUGHT, "left is closer"):
        msgs = opening_messages("corridor", "You are at 3.") + [
            {"role": "assistant", "content": react_reply("textcraft", "inventory", thought)}]
        trajs.append(Trajectory("corridor", 0, 0, msgs, [], [], [], status="done", reward=1.0))
    # no reply
    trajs.append(Trajectory("corridor", 0, 0, opening_messages("corridor", "You are at 3."), [], [],
                            []))
    m = run_layer.rollout_metrics(trajs, 4)
    assert m["guess_share"] == 2 / 5 and m["success_rate"] == 4 / 5


def test_micro_batches_accumulate_to_the_full_batch_gradient(cache_dir):
    """Splitting a mini-batch into micro-batches (any aggregation mode) gives the same update."""
    import copy

    import torch

    from env_server.app import serve_in_thread
    from env_server.corridor import CorridorEnv
    from env_client import EnvPool
    from engines import HFEngine
    from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = train.parse_args([*TINY, "--cache-dir", cache_dir])
    path = models.default_model_path(cfg.env, cfg.cache_dir)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    url, stop = serve_in_thread(CorridorEnv)
    fmt, rcfg = ChatFormat(tok), RolloutConfig(max_turns=3, max_new_tokens=5)
    with EnvPool(url, 6) as pool:
        policy = EnginePolicy(HFEngine(model, tok.pad_token_id), fmt, rcfg,
                              torch.Generator().manual_seed(1))
        trajs = rollout(policy, pool, "corridor", [0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2], rcfg,
                        fmt=fmt)
    stop()
    trajs[0].reward = trajs[3].reward = 1.0  # make the advantages non-zero
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        results = []
        for micro in (100_000, 1):  # one micro-batch / one row per micro-batch
            c = train.parse_args([*TINY, "--loss-agg", mode, "--micro-batch-tokens", str(micro)])
            m = copy.deepcopy(model)
            train_update(update_run(c, m, {"policy": torch.optim.SGD(m.parameters(), lr=1.0)},
                                    pad=tok.pad_token_id), trajs)
            results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert (results[0] - before).abs().max() > 1e-6
        assert torch.allclose(results[0], results[1], atol=1e-6), mode


def test_masked_logprobs_equal_the_full_forward():
    """token_logprobs with a mask runs the LM head on the masked positions only: same values there
    (log-probs and entropies), 0 elsewhere, same gradients."""
    import torch

    from models.tiny import build_model
    model = build_model(vocab_size=50, layers=2, hidden=32, heads=2)
    ids = torch.randint(0, 50, (3, 12))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
          "position_ids": torch.arange(12).repeat(3, 1)}
    mask = (torch.rand(3, 11) < 0.4).long()
    mask[0, 3] = 1
    full_lp, full_ent = policy.token_logprobs(model, mb, 0.7, with_entropy=True)
    lp, ent = policy.token_logprobs(model, mb, 0.7, with_entropy=True, mask=mask)
    assert algos.head_split_ok(model)
    m = mask.bool()
    assert (torch.allclose(lp[m], full_lp[m], atol=1e-5)
            and torch.allclose(ent[m], full_ent[m], atol=1e-5))
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    grads = []
    for lps in (full_lp, lp):
        model.zero_grad()
        torch.where(m, lps, 0.0).sum().backward(retain_graph=True)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_the_head_split_is_checked_per_model_not_per_class():
    """Two models of one class, one scaling its logits (Granite's logits_scaling): the masked LM
    head is used for the one whose logits it reproduces only, whichever is checked first."""
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    def granite(scaling):
        torch.manual_seed(0)
        return GraniteForCausalLM(GraniteConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, logits_scaling=scaling))
    plain, scaled = granite(1.0), granite(4.0)
    assert algos.head_split_ok(plain) and not algos.head_split_ok(scaled)
    ids = torch.randint(0, 50, (2, 9))
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
          "position_ids": torch.arange(9).repeat(2, 1)}
    mask = torch.ones(2, 8)
    full, _ = policy.token_logprobs(scaled, mb, 1.0)
    masked, _ = policy.token_logprobs(scaled, mb, 1.0, mask=mask)
    assert torch.allclose(masked, full, atol=1e-5)


def test_spread_picks_evenly():
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread([5, 6], 0) == [5, 6] and spread([5, 6], 9) == [5, 6]


def test_warm_start_is_built_once_and_named_after_its_recipe(tmp_path, monkeypatch):
    """default_model_path builds the recipe's SFT model into the cache once, records it, and reuses
    it."""
    recipe = dict(copy_steps=3, tasks=4, noise=0.0, epochs=1, lr=1e-3, batch_size=2)
    monkeypatch.setitem(warmstart.WARM_START, "corridor", recipe)
    path = models.default_model_path("corridor", str(tmp_path))
    assert path.endswith("-warm-batch_size2-copy_steps3-epochs1-lr0.001-noise0.0-tasks4")
    info = json.load(open(os.path.join(path, "warm_start.json")))
    assert info["tasks"] == 4 and info["recipe"] == recipe and len(info["sft_loss"]) == 1
    assert len(info["copy_loss"]) == 2  # every 50th step's and the last
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    assert models.default_model_path("corridor", str(tmp_path)) == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp  # reused, not rebuilt
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    # stage 1 has its own folder, which another SFT recipe reuses
    copied = models.tiny_model_path("corridor", str(tmp_path)) + "-copy3"
    assert (json.load(open(os.path.join(copied, "copy_stage.json")))["copy_loss"]
            == info["copy_loss"])
    stamp = os.path.getmtime(os.path.join(copied, "config.json"))
    monkeypatch.setitem(warmstart.WARM_START, "corridor", {**recipe, "epochs": 2})
    other = models.default_model_path("corridor", str(tmp_path))
    assert other != path and len(
        json.load(open(os.path.join(other, "warm_start.json")))["sft_loss"]) == 2
    assert os.path.getmtime(os.path.join(copied, "config.json")) == stamp
    with pytest.raises(ValueError, match="after 3 copy steps; the corridor warm start needs 5"):
        monkeypatch.setitem(warmstart.WARM_START, "corridor", {**recipe, "copy_steps": 5})
        warmstart.warm_start("corridor", copied, str(tmp_path / "bad"))
    # stage 3, a guessing habit, starts from the stage-2 folder of the same recipe and keeps it
    monkeypatch.setitem(warmstart.WARM_START, "corridor", {**recipe, "guess": 0.5, "guess_turns": 2,
                                                           "guess_epochs": 1, "guess_lr": 1e-3})
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    habit = models.default_model_path("corridor", str(tmp_path))
    assert habit == path + "-guess-guess0.5-guess_turns2-guess_epochs1-guess_lr0.001"
    info = json.load(open(os.path.join(habit, "guess_stage.json")))
    assert info["base"] == path and info["trajectories"] == 8 and info["guesser_share"] == 0.5
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp
    # a stalling habit: the action goes into the folder's name without its spaces, and into the data
    monkeypatch.setitem(warmstart.WARM_START, "corridor", {**recipe, "guess": 0.5, "guess_turns": 2,
                                                           "guess_action": "wait here",
                                                           "guess_epochs": 1, "guess_lr": 1e-3})
    stall = models.default_model_path("corridor", str(tmp_path))
    assert stall == (path + "-guess-guess0.5-guess_turns2-guess_actionwait_here"
                     "-guess_epochs1-guess_lr0.001")
    assert json.load(open(os.path.join(stall, "guess_stage.json")))["guesser_share"] == 0.5
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp
    with pytest.raises(ValueError, match="no warm_start.json"):
        warmstart.guess_stage("corridor", copied, str(tmp_path / "bad"))
    monkeypatch.delitem(warmstart.WARM_START, "corridor")
    assert (models.default_model_path("corridor", str(tmp_path))
            == models.tiny_model_path("corridor", str(tmp_path)))


def test_the_update_has_every_core_and_rollouts_leave_one(tmp_path, cache_dir, monkeypatch):
    """--threads 0: torch gets all cores but one while env servers work, and all of them in the
    update."""
    seen = []
    real_update = train.update

    def update(*args, **kw):
        seen.append(("update", torch.get_num_threads()))
        return real_update(*args, **kw)

    real_rollout = train.rollout

    def rollout(*args, **kw):
        seen.append(("rollout", torch.get_num_threads()))
        return real_rollout(*args, **kw)

    monkeypatch.setattr(train, "update", update)
    monkeypatch.setattr(train, "rollout", rollout)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    args = list(TINY)
    args[args.index("--threads") + 1] = "0"  # the default
    try:
        train.main(train.parse_args([*args, "--steps", "2", "--schedule", "3",
                                     "--out", str(tmp_path / "run"),
                                     "--cache-dir", cache_dir]))
    finally:
        torch.set_num_threads(before)
    cores = os.cpu_count() or 1
    assert seen == [("rollout", max(1, cores - 1)), ("update", cores)] * 2


def test_the_sampler_gets_weights_only_after_an_update(tmp_path, cache_dir, monkeypatch):
    """A step lost to env errors changes no weight, so nothing is copied to the sampler; the next
    step, trained on, copies its new weights."""
    seen, real_rollout, real_sync = [], train.rollout, HFEngine.sync_weights

    def rollout(*args, **kw):
        trajs = real_rollout(*args, **kw)
        if not seen:  # the first step: every episode an env error
            for t in trajs:
                t.status, t.error = "env_error", "injected"
        seen.append("rollout")
        return trajs

    def sync_weights(self, model):
        seen.append("sync")
        return real_sync(self, model)

    monkeypatch.setattr(train, "rollout", rollout)
    monkeypatch.setattr(HFEngine, "sync_weights", sync_weights)
    before = torch.get_num_threads()
    out = str(tmp_path / "run")
    try:
        train.main(train.parse_args([*TINY, "--steps", "2", "--schedule", "2", "--out", out,
                                     "--cache-dir", cache_dir]))
    finally:
        torch.set_num_threads(before)
    assert seen == ["rollout", "rollout", "sync"]
    m = metrics(out)
    assert [x["skipped_update"] for x in m] == [1, 0] and m[0]["time_sync_s"] == 0.0


def test_by_default_a_checkpoint_every_5_steps_and_at_the_end(tmp_path, cache_dir, monkeypatch):
    """The default --save-every 5: a run killed outright (no exception to catch) loses at most 4
    steps; the tiny model's checkpoint costs about 0.1 s (docs/reliability.md)."""
    saved, real_save = [], run_layer.save
    monkeypatch.setattr(run_layer, "save", lambda run, step, snap: (saved.append(step),
                                                                    real_save(run, step, snap)))
    before = torch.get_num_threads()
    try:
        train.main(train.parse_args([*TINY, "--steps", "6", "--schedule", "2",
                                     "--out", str(tmp_path / "run"), "--cache-dir", cache_dir]))
    finally:
        torch.set_num_threads(before)
    assert saved == [5, 6]


def test_an_update_with_every_row_idle_logs_none_where_nothing_was_measured():
    """A step whose rows all carry no signal forwards none: its loss, 0, is exact, but the
    entropy, clip statistics, sampler gap and padding share were not measured (not 0, nor a
    padding share of 1); a KL term is logged only with a reference model, as the value loss
    only with a critic."""
    stats = run_layer.UpdateStats()
    stats.grad_norms = [0.0]
    m = stats.metrics(SimpleNamespace(model=object(), ref=None, critic=None), 1, idle=4)
    assert m["loss"] == 0 and "kl" not in m and "value_loss" not in m
    for k in ("entropy", "clip_frac", "approx_kl", "logprob_diff", "logprob_kl", "padding_share"):
        assert m[k] is None, k
    assert m["train_tokens"] == 0 and m["idle_rows"] == 4
    m = stats.metrics(SimpleNamespace(model=object(), ref=object(), critic=None), 1, idle=4)
    assert m["kl"] == 0


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_step_whose_gradient_is_not_finite_leaves_the_weights(tmp_path, monkeypatch, cache_dir,
                                                               bad):
    """A NaN loss (a NaN coefficient once made one) gives a NaN gradient; a gradient whose norm
    is infinite (no NaN: its clipped gradient is finite) is as bad. Either way the optimizer step
    is skipped, so the checkpoint holds the start's finite weights, and grad_norm logs it."""
    from safetensors.torch import load_file
    real = algos.policy_loss

    def nan_loss(*args, **kw):
        loss, stats = real(*args, **kw)
        return loss * float("nan"), stats

    if bad == "nan":
        monkeypatch.setattr(algos, "policy_loss", nan_loss)
    else:  # the gradients stay finite: only the rule on the norm can keep the weights
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                            lambda params, max_norm: torch.tensor(float("inf")))
    out = tmp_path / "run"
    train.main(train.parse_args([*TINY, "--steps", "1", "--entropy-coef", "0.01", "--eval-every",
                                 "0", "--batch-size", "4", "--group-size", "4",  # rows to train
                                 "--out", str(out), "--cache-dir", cache_dir]))
    start = load_file(os.path.join(models.default_model_path("corridor", cache_dir),
                                   "model.safetensors"))
    end = load_file(out / "checkpoint" / "model" / "model.safetensors")
    assert all(torch.equal(end[k], v) for k, v in start.items())
    m = metrics(str(out))[0]
    assert m["train_tokens"] > 0  # a step with rows to train on: applied, it would move weights
    assert math.isnan(m["grad_norm"]) if bad == "nan" else m["grad_norm"] == float("inf")


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    """Two runs into one --out interleave their metrics and overwrite each other's checkpoint:
    while a process holds the folder (OUT/.lock), train.py is refused in one line naming it, a
    --resume too; the lock goes with its process, kill -9 included."""
    from trainer.checkpoints import FolderInUse, folder_holder, hold_folder

    out = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); "
        "from trainer.checkpoints import hold_folder; h = hold_folder(sys.argv[2]); "
        "print('held', flush=True); time.sleep(60)"), ROOT, str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert folder_holder(str(out)).startswith(f"pid {holder.pid}: ")
        for more in ([], ["--resume"]):
            with pytest.raises(SystemExit) as e:
                train.parse_args([*TINY, "--out", str(out), *more])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"is in use by pid {holder.pid}" in err, err
            assert len(err.strip().splitlines()) == 1
        with pytest.raises(FolderInUse):  # the start's own take, should two pass the check
            hold_folder(str(out))
    finally:
        holder.kill()
        holder.wait()
    assert folder_holder(str(out)) is None  # killed: free
    hold_folder(str(out)).close()


def test_an_exception_in_an_update_keeps_the_last_finished_step(tmp_path, cache_dir,
                                                               monkeypatch):
    """--save-every 0 saves at the end only; an exception in step 3's update, before any weight
    moved, used to save nothing (two finished steps lost, --resume: no checkpoint). Now step 2 is
    saved, and the resumed run ends as the unbroken one."""
    import trainer.checkpoints as ckpts
    calls, real = [], train.advantages

    def failing(run, rows):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in the estimator")
        return real(run, rows)

    args = [*TINY, "--steps", "4", "--save-every", "0", "--eval-every", "0", "--threads", "1",
            "--batch-size", "4", "--group-size", "4", "--cache-dir", cache_dir]
    monkeypatch.setattr(train, "advantages", failing)
    with pytest.raises(RuntimeError) as e:
        train.main(train.parse_args([*args, "--out", str(tmp_path / "cut")]))
    assert "the last whole step saved" in "".join(getattr(e.value, "__notes__", []))
    state = ckpts.load_data(str(tmp_path / "cut" / "checkpoint" / "trainer_state.pt"))
    done = [m["step"] for m in metrics(tmp_path / "cut") if m.get("loss") is not None]
    assert state["step"] == len(metrics(tmp_path / "cut")) and len(done) == 2
    monkeypatch.setattr(train, "advantages", real)
    train.main(train.parse_args(["--resume", "--out", str(tmp_path / "cut"), "--threads", "1",
                                 "--cache-dir", cache_dir]))
    train.main(train.parse_args([*args, "--out", str(tmp_path / "whole")]))
    losses = lambda d: [m.get("loss") for m in metrics(d)]  # noqa: E731
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")

