"""sft.py and warmstart.py: expert rows equal the chat template (same token path as rollouts), SFT
lowers the loss and makes a tiny model solve Corridor tasks it could not, AgentEvol and DPO run,
pairs stay within a task, and the command line saves a loadable model and names bad flags."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, exit_of, sampled_runs

from recipes import sft
from models import warmstart
from env_server.app import serve_in_thread
from env_server.corridor import CorridorEnv
from env_server.agents import opens_by_guessing, react_reply
from rollout import ChatFormat, RolloutConfig, Trajectory, is_success
from trainer.run import write_log

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
FIXTURES = os.environ.get("TOKENIZER_FIXTURES",
                          os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                       "tokenizers"))


@pytest.fixture(scope="module")
def corridor_model_path(tmp_path_factory):
    import models.tiny as tiny_model
    return tiny_model.build(str(tmp_path_factory.mktemp("tiny") / "corridor"),
                            env_names=("corridor",), tokenizer="words", layers=2, hidden=64)


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def corridor_url():
    url, stop = serve_in_thread(CorridorEnv)
    yield url
    stop()


def textcraft_tokenizers():
    """Real chat tokenizers: BPE (Qwen2.5, Qwen3) and SentencePiece (Phi-3), when the fixtures
    exist."""
    from transformers import AutoTokenizer
    paths = [os.path.join(FIXTURES, n) for n in ("qwen2.5-instruct", "qwen3", "phi-3-mini")]
    return [AutoTokenizer.from_pretrained(p) for p in paths if os.path.isdir(p)]


def check_rows(fmt, trajs):
    for t in trajs:
        # the row is the template's tokenisation of the conversation up to the last reply's end of
        # turn
        full = fmt.encode(fmt.tok.apply_chat_template(t.messages, tokenize=False,
                                                      add_generation_prompt=True))
        assert full[:len(t.token_ids)] == t.token_ids
        assert full[len(t.token_ids):] == fmt.observation_ids(t.messages[-1]["content"],
                                                              reply_ended=True)
        # the loss mask covers exactly the replies and their end-of-turn tokens
        replies = [m["content"] for m in t.messages[3:] if m["role"] == "assistant"]
        assert sampled_runs(t) == [fmt.reply_ids(r) for r in replies]
        assert len(replies) == t.turns and len(t.loss_mask) == len(t.token_ids) == len(t.logprobs)


def test_expert_rows_match_the_chat_template(corridor_model_path):
    _, tok = load(corridor_model_path)
    fmt = ChatFormat(tok)
    trajs = warmstart.expert_trajectories("corridor", [0, 5, 48], fmt)
    assert all(t.status == "done" and t.reward == 1.0 for t in trajs)
    assert [t.turns for t in trajs] == [1, 4, 3]  # distances 1, 4 (training) and 3 (test)
    assert trajs[1].messages[3]["content"] == react_reply("corridor", "left")
    check_rows(fmt, trajs)
    capped = warmstart.expert_trajectories("corridor", [4],
                                           ChatFormat(load(corridor_model_path)[1]),
                                           noise=1.0, max_turns=3)
    assert capped[0].status == "max_turns" and capped[0].turns == 3 and capped[0].reward == 0.0
    # won_only: the episode the expert does not win within max_turns (distance 4 in 2 turns) is left
    # out
    both = warmstart.expert_trajectories("corridor", [0, 5], fmt, max_turns=2)
    assert [(t.item_id, t.status) for t in both] == [(0, "done"), (5, "max_turns")]
    won = warmstart.expert_trajectories("corridor", [0, 5], fmt, max_turns=2, won_only=True)
    assert [(t.item_id, t.status) for t in won] == [(0, "done")]


def test_the_guesser_plays_its_share_of_episodes_and_keeps_guessing(corridor_model_path):
    """expert_trajectories(guess=g): the expert's episodes first, then the guesser's (a share g of
    all), on the tasks in shuffled turn; every guesser reply thinks GUESS_THOUGHT over a wrong
    action."""
    fmt = ChatFormat(load(corridor_model_path)[1])
    ids = [5, 6, 7, 8]
    clean = warmstart.expert_trajectories("corridor", ids, fmt)
    mixed = warmstart.expert_trajectories("corridor", ids, fmt, guess=0.75, guess_turns=2)
    assert len(mixed) == 16 and [t.messages for t in mixed[:4]] == [t.messages for t in clean]
    guessers = mixed[4:]
    assert sorted(t.item_id for t in guessers) == sorted(ids * 3)
    assert [opens_by_guessing(t.messages) for t in mixed] == [False] * 4 + [True] * 12
    expert = {t.item_id: t.messages[3]["content"] for t in clean}  # Corridor's: the move alone
    for t in guessers:
        replies = [m["content"] for m in t.messages[3::2]]
        assert t.turns == len(replies) <= 2 and all(warmstart.GUESS_THOUGHT in r for r in replies)
        assert replies[0].split("Action: ")[1] != expert[t.item_id]  # never the expert's first move
    assert all(t.turns == 2 for t in guessers if t.status == "max_turns")
    check_rows(fmt, mixed)
    assert len(warmstart.expert_trajectories("corridor", ids, fmt, guess=0.5)) == 8
    with pytest.raises(AssertionError, match="guess"):
        warmstart.expert_trajectories("corridor", ids, fmt, guess=1.0)


def test_a_stalling_guesser_repeats_one_action_and_sees_the_same_thing(corridor_model_path,
                                                                      monkeypatch):
    """expert_trajectories(guess_action=a): the guesser's every reply is STALL_THOUGHT over `a`, for
    guess_turns turns, without asking the expert; on a no-op action each observation repeats the
    last."""
    fmt = ChatFormat(load(corridor_model_path)[1])
    ids = [5, 6]
    clean = warmstart.expert_trajectories("corridor", ids, fmt)
    from env_server import get_env_class
    cls, asked = get_env_class("corridor"), []
    expert = cls.expert_action
    monkeypatch.setattr(cls, "expert_action", lambda self: asked.append(1) or expert(self))
    mixed = warmstart.expert_trajectories("corridor", ids, fmt, guess=0.5, guess_turns=4,
                                          guess_action="wait")
    assert len(asked) == sum(t.turns for t in clean)  # once per expert turn, never for the guesser
    assert [t.messages for t in mixed[:2]] == [t.messages for t in clean]
    for t in mixed[2:]:
        assert opens_by_guessing(t.messages) and t.turns == 4 and t.status == "max_turns"
        assert ({m["content"] for m in t.messages[3::2]}
                == {f"Thought: {warmstart.STALL_THOUGHT}\nAction: wait"})
        seen = [m["content"] for m in t.messages[2::2]]  # the first observation, then one per turn
        assert len(seen) == 5 and len(set(seen)) == 1
    check_rows(fmt, mixed)


def test_expert_rows_match_real_chat_templates():
    """TextCraft expert rows, with noise and with task variants, are exactly what Qwen2.5's, Qwen3's
    and Phi-3's templates tokenise (Phi-3's SentencePiece needs replies tokenised in context)."""
    toks = textcraft_tokenizers()
    if not toks:
        pytest.skip(f"tokenizer fixtures not found at {FIXTURES} (set TOKENIZER_FIXTURES)")
    for tok in toks:
        fmt = ChatFormat(tok)
        trajs = warmstart.expert_trajectories("textcraft", [0, 1, 2], fmt, noise=0.3, seed=1)
        assert all(t.status == "done" and t.reward == 1.0 for t in trajs)
        check_rows(fmt, trajs)
        clean = warmstart.expert_trajectories("textcraft", [0, 1, 2], fmt)
        assert sum(t.turns for t in trajs) > sum(t.turns for t in clean)  # wrong actions cost turns
        varied = warmstart.expert_trajectories("textcraft", [40, 41], fmt, variants=2)
        assert ([t.item_id for t in varied] == [40, 41, 40, 41]
                and all(t.reward == 1.0 for t in varied))
        # other distractors
        assert varied[0].messages[2]["content"] != varied[2].messages[2]["content"]
        assert (varied[0].messages[2]["content"].splitlines()[-1]
                == varied[2].messages[2]["content"].splitlines()[-1])
        check_rows(fmt, varied)
        # the expert thinks aloud (the recipes from the goal down), a swapped-in wrong action does
        # not
        thoughts = [m["content"].splitlines()[0] for t in trajs for m in t.messages[3::2]]
        assert (sum(" using " in x for x in thoughts)
                > sum(x.startswith("Thought: I will ") for x in thoughts) > 0)
        plain = warmstart.expert_trajectories("textcraft", [0, 1, 2], fmt, thoughts=False)
        assert all(m["content"].startswith("Thought: I will ")
                   for t in plain for m in t.messages[3::2])
        assert [t.turns for t in plain] == [t.turns for t in clean]
        checked = warmstart.expert_trajectories("textcraft", [0, 1, 2], fmt, thoughts="checked")
        first = [m["content"].splitlines()[0] for t in checked for m in t.messages[3::2]]
        assert ([t.turns for t in checked] == [t.turns for t in clean]
                and all(": get" in x for x in first))
        check_rows(fmt, checked)
    with pytest.raises(ValueError, match="no task variants"):
        warmstart.expert_trajectories("corridor", [0], ChatFormat(toks[0]), variants=2)


def test_sft_lowers_loss_and_solves_more_corridor_tasks(corridor_model_path, corridor_url):
    model, tok = load(corridor_model_path)
    fmt = ChatFormat(tok)
    data = warmstart.expert_trajectories("corridor", list(range(48)), fmt)
    rcfg = RolloutConfig(max_turns=6, max_new_tokens=16, temperature=0.0)
    test_ids = list(range(48, 60))

    def solved():
        return sum(map(is_success, sft.play(model, tok, corridor_url, "corridor", test_ids, rcfg)))

    before = solved()
    losses = warmstart.sft(model, tok, data, epochs=8, lr=3e-3, batch_size=4, progress=False)
    after = solved()
    print(f"corridor SFT: loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"solved {before} -> {after} of 12")
    assert losses[-1] < 0.3 * losses[0]
    assert after > before


def test_copy_batch_shows_each_sequence_twice():
    import random
    rows = warmstart.copy_batch(random.Random(0), list(range(3, 40)), [list(range(100, 160))], 6,
                                12)
    assert len(rows) == 6
    for b, (ids, mask) in enumerate(rows):
        n = len(ids) // 2
        assert ids[:n] == ids[n:] and 8 <= n <= 12 and mask == [0] * n + [1] * n
        assert all(100 <= i < 160 for i in ids) == (b % 2 == 1)  # odd rows: spans of the text


def test_copy_pretraining_teaches_copying_from_context(corridor_model_path):
    """On sequences of random tokens, nothing but the first copy can predict the second: a loss
    there below ln(vocab), the uniform guess, means the model reads its context."""
    import math
    import random

    import models.tiny as tiny_model
    model, tok = load(corridor_model_path)
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    held_out = warmstart.copy_batch(random.Random(99), vocab, [], 64, 16)  # random tokens only
    # the loss on the first copy instead
    first = [(ids, [1 - m for m in mask]) for ids, mask in held_out]

    def losses():
        with torch.no_grad():
            return (float(warmstart.copy_loss(model, first, tok.pad_token_id)),
                    float(warmstart.copy_loss(model, held_out, tok.pad_token_id)))

    before = losses()
    warmstart.copy_pretrain(model, tok, tiny_model.corpus(("corridor",), 20), 300, lr=3e-3,
                            batch_size=16, max_len=16, progress=False)
    after = losses()
    print(f"copy loss (first copy, second copy): {before} -> {after}; "
          f"uniform {math.log(len(vocab)):.3f}")
    assert before[1] > math.log(len(vocab)) - 0.1  # untrained: no better than uniform
    assert after[1] < math.log(len(vocab)) - 0.25 and after[1] < after[0] - 1.0


def test_agent_evol_runs_one_iteration(corridor_model_path, corridor_url, monkeypatch):
    model, tok = load(corridor_model_path)
    seed_data = warmstart.expert_trajectories("corridor", [0, 1], ChatFormat(tok))
    calls, real = [], sft.sft
    monkeypatch.setattr(sft, "sft", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rates = sft.agent_evol(model, tok, corridor_url, "corridor", [0, 1, 2], iterations=1,
                           samples_per_task=2, data=seed_data, max_turns=3, max_new_tokens=8,
                           lr=1e-3, progress=False, batch_size=4, dtype=torch.float32)
    assert len(rates) == 1 and 0.0 <= rates[0] <= 1.0
    # each round fine-tunes with the flags the first pass had (--batch-size, --dtype)
    assert calls and all(c["batch_size"] == 4 and c["dtype"] == torch.float32 for c in calls)


def test_dpo_loss_decreases_on_one_pair(corridor_model_path):
    import copy
    model, tok = load(corridor_model_path)
    fmt = ChatFormat(tok)
    chosen = warmstart.expert_trajectories("corridor", [2], fmt)[0]
    rejected = warmstart.expert_trajectories("corridor", [2], fmt, noise=1.0, max_turns=3)[0]
    assert is_success(chosen) and not is_success(rejected)
    ref = copy.deepcopy(model)
    losses = sft.dpo(model, ref, tok, [(chosen, rejected)] * 5, beta=0.1, lr=1e-3, batch_size=1,
                     progress=False)
    assert len(losses) == 5
    # policy == reference at the start
    assert abs(losses[0] - torch.log(torch.tensor(2.0)).item()) < 1e-4
    assert losses[-1] < losses[0]


def traj(item, status, reward):
    return Trajectory("corridor", item, 0, [], [1, 2], [0, 1], [0.0, 0.0], 1, status, reward)


def test_make_pairs_stays_within_an_item():
    ts = [traj(0, "done", 1.0), traj(0, "max_turns", 0.0), traj(0, "max_turns", 0.0),
          traj(1, "done", 1.0),
          traj(2, "max_turns", 0.0), traj(3, "done", 1.0), traj(3, "env_error", 0.0)]
    pairs = sft.make_pairs(ts)
    assert len(pairs) == 2
    for c, r in pairs:
        assert c.item_id == r.item_id == 0 and is_success(c) and not is_success(r)
    assert {id(r) for _, r in pairs} == {id(ts[1]), id(ts[2])}


def test_load_log_reads_files_and_folders(tmp_path, corridor_model_path):
    trajs = warmstart.expert_trajectories("corridor", [0, 1],
                                          ChatFormat(load(corridor_model_path)[1]))
    trajs[1].reward, trajs[1].status = 0.0, "max_turns"
    write_log(str(tmp_path / "rollouts" / "step_000001.jsonl"), 1, 6, trajs)
    assert len(sft.load_log(str(tmp_path))) == 2
    got = sft.load_log(str(tmp_path / "rollouts" / "step_000001.jsonl"), successful_only=True)
    assert (len(got) == 1 and got[0].token_ids == trajs[0].token_ids
            and got[0].loss_mask == trajs[0].loss_mask)
    with pytest.raises(FileNotFoundError, match="nope"):
        sft.load_log(str(tmp_path / "nope"))


def run_cli(args):
    return subprocess.run([sys.executable, "-m", "recipes.sft", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_saves_a_model_and_names_bad_flags(tmp_path, corridor_model_path, capsys):
    """`python -m recipes.sft` saves a loadable model and prints its summary; each bad flag or
    --from-log ends it naming the flag, without a traceback: one as its user sees it (exit code,
    stderr), the rest through sft.main(sft.parse_args(...)) here, as __main__ calls them."""
    out = tmp_path / "out"
    r = run_cli(["--env", "corridor", "--model", corridor_model_path, "--out", str(out),
                 "--tasks", "0-7", "--epochs", "2", "--noise", "0.2", "--threads", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["trajectories"] == 8 and len(summary["sft_loss"]) == 2
    model, tok = load(str(out))
    assert tok.chat_template and model.config.vocab_size == len(tok)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "no_logs").mkdir()
    for args, words in [(["--from-log", str(tmp_path / "missing")], "--from-log"),
                        (["--from-log", str(tmp_path / "no_logs")], "--from-log: no step_"),
                        (["--from-log", str(tmp_path / "a_file")], "--from-log: no usable"),
                        (["--success-only"], "--success-only"), (["--tasks", "5-3"], "backwards"),
                        (["--out", str(tmp_path / "a_file")], "is a file"),
                        (["--noise", "2"], "--noise"),
                        (["--guess", "1"], "--guess"),
                        (["--guess-action", "wait"], "--guess-action"),
                        (["--tasks", "0,999"], "out of range"), (["--mode", "ppo"], "--mode"),
                        (["--checked-thoughts", "--plain-thoughts"], "--checked-thoughts")]:
        argv = ["--env", "corridor", "--out", str(out), *args]
        if words == "--from-log: no usable":  # the one run as a command
            r = run_cli(argv)
            assert r.returncode != 0 and words in r.stderr, (args, r.stderr[-500:])
            assert "Traceback" not in r.stderr, (args, r.stderr[-500:])
            continue
        threads = torch.get_num_threads()
        try:  # its message, or argparse's line
            code, _, err = exit_of(lambda: sft.main(sft.parse_args(argv)), capsys)
        finally:
            torch.set_num_threads(threads)
        assert code not in (0, None) and words in err + str(code), (args, err)
