"""rollout.py: token-in/token-out rows checked against real chat templates (Qwen2.5, Qwen3, Phi-3),
loss masks, statuses, the batch builder, the HF engine's log-probs against a plain forward pass,
and the scripts refusing a template that cannot mark turns."""

import os
import warnings

import pytest
import torch
from conftest import sampled_runs
from test_cli import one_line_error, run

from env_server.agents import ONE_ACTION_ERROR
from env_client import EnvPool, Step
from env_server.app import serve_in_thread
from env_server.textcraft import TextCraftEnv
from engines import HFEngine, Sample
from distributed import build_batch, length_buckets
from rollout import ChatFormat, EnginePolicy, Reply, RolloutConfig, is_success, rollout
import train
from trainer.run import write_log

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FIXTURES = os.environ.get("TOKENIZER_FIXTURES",
                          os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                       "tokenizers"))


def real_tokenizer(name):
    path = os.path.join(FIXTURES, name)
    if not os.path.isdir(path):
        pytest.skip(f"tokenizer fixtures not found at {path} (set TOKENIZER_FIXTURES)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class ScriptedEngine:
    """Replies from a script, tokenised canonically, ending with the end-of-turn token (or `end`)
    unless `cut`."""

    def __init__(self, fmt, replies, cut=(), end=None, spelled=()):
        self.fmt, self.replies, self.cut, self.turn = fmt, replies, set(cut), 0
        self.end = fmt.eot_id if end is None else end
        self.spelled = set(spelled)  # turns whose reply is sampled one character a token

    def generate(self, prompts, max_new_tokens, stop_ids, temperature=1.0, top_p=1.0,
                 generator=None, reuse=False):
        reply = self.replies[self.turn % len(self.replies)]
        stopped = self.turn not in self.cut
        self.turn += 1
        out = []
        spelled = self.turn - 1 in self.spelled
        for p in prompts:
            ids = ([i for c in reply for i in self.fmt.encode(c)] if spelled
                   else in_context(self.fmt, p, reply)) + ([self.end] if stopped else [])
            out.append(Sample(ids, [-0.5] * len(ids), stopped))
        return out

    def forget(self):
        pass


def in_context(fmt, prompt_ids, reply):
    """The canonical tokens of `reply` right after `prompt_ids`, as the template's own tokenisation
    would have them (SentencePiece tokenizers such as Phi-3's tokenise a word differently at the
    start of a string)."""
    prompt_text = fmt.tok.decode(prompt_ids, skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
    ids = fmt.encode(prompt_text + reply)
    assert ids[:len(prompt_ids)] == prompt_ids
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def textcraft_url():
    url, stop = serve_in_thread(TextCraftEnv)
    yield url
    stop()


REPLIES = ["Thought: check.\nAction: inventory", "Thought: logs.\nAction: get 1 oak log",
           "Action: get 1 stick\nAction: inventory"]


def play(url, tok, replies, n=2, cut=(), end=None, spelled=(), **cfg):
    fmt = ChatFormat(tok)
    with EnvPool(url, n) as pool:
        rcfg = RolloutConfig(**{"max_turns": 3, **cfg})
        engine = ScriptedEngine(fmt, replies, cut, end, spelled)
        trajs = rollout(EnginePolicy(engine, fmt, rcfg), pool,
                        "textcraft", list(range(n)), list(range(n)), rcfg, fmt=fmt)
    return fmt, trajs


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "phi-3-mini", "qwen3"])
def test_rows_equal_the_chat_template(textcraft_url, name):
    tok = real_tokenizer(name)
    fmt, trajs = play(textcraft_url, tok, REPLIES)
    for t in trajs:
        assert t.status == "max_turns" and t.turns == 3 and t.template == "exact"
        # the third reply broke the one-Action rule
        assert t.messages[-1]["content"] == ONE_ACTION_ERROR
        # the loss mask covers exactly what the policy produced: each reply and its end-of-turn
        # token
        assert ([fmt.tok.decode(r) for r in sampled_runs(t)]
                == [fmt.tok.decode(fmt.encode(r) + [fmt.eot_id]) for r in REPLIES])
        assert (len(t.logprobs) == len(t.token_ids)
                and all(lp == 0 for lp, m in zip(t.logprobs, t.loss_mask) if not m))
        # the whole row is the template's tokenisation of the conversation, up to the final
        # reply's end-of-turn token (the last observation came after the final turn, so it is not
        # in the row)
        full = fmt.encode(tok.apply_chat_template(t.messages, tokenize=False,
                                                  add_generation_prompt=True))
        assert full[:len(t.token_ids)] == t.token_ids
        assert full[len(t.token_ids):] == fmt.observation_ids(t.messages[-1]["content"],
                                                              reply_ended=True)


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "phi-3-mini"])
def test_reply_cut_at_max_tokens_gets_an_unsampled_end_of_turn(textcraft_url, name):
    tok = real_tokenizer(name)
    fmt, trajs = play(textcraft_url, tok, REPLIES, cut={0})
    t = trajs[0]
    assert t.template == "exact"
    start = t.n_prompt
    first_reply = in_context(fmt, t.token_ids[:start], REPLIES[0])
    assert t.token_ids[start:start + len(first_reply) + 1] == first_reply + [fmt.eot_id]
    assert t.loss_mask[start:start + len(first_reply) + 1] == [1] * len(first_reply) + [0]


@pytest.mark.parametrize("turns", [{0, 1, 2}, {2}])
def test_a_reply_sampled_in_other_tokens_than_the_templates_is_noncanonical(textcraft_url, turns):
    """The same text in other ids (one character a token) marks the row "noncanonical", from any
    turn: the last reply ends the row with no observation after it, and is checked all the same."""
    fmt, trajs = play(textcraft_url, real_tokenizer("qwen2.5-instruct"), REPLIES, spelled=turns)
    assert all(t.turns == 3 and t.template == "noncanonical" for t in trajs)
    fmt, trajs = play(textcraft_url, real_tokenizer("qwen2.5-instruct"), REPLIES)
    assert all(t.template == "exact" for t in trajs)


def test_a_reply_ended_by_eos_gets_the_end_of_turn_token_too(textcraft_url):
    """Phi-3's eos (<|endoftext|>) is not its end-of-turn token (<|end|>), and both stop sampling:
    a reply ended by eos keeps it (sampled, mask 1), then the unsampled end-of-turn token closes
    the turn (mask 0) before the next user turn."""
    tok = real_tokenizer("phi-3-mini")
    fmt, trajs = play(textcraft_url, tok, REPLIES, end=tok.eos_token_id)
    assert fmt.eot_id != tok.eos_token_id
    t = trajs[0]
    start = t.n_prompt
    first_reply = in_context(fmt, t.token_ids[:start], REPLIES[0])
    end = start + len(first_reply) + 2
    assert t.token_ids[start:end] == first_reply + [tok.eos_token_id, fmt.eot_id]
    assert t.loss_mask[start:end] == [1] * (len(first_reply) + 1) + [0]
    # the env and the logs saw the reply without eos
    assert REPLIES[0] in [m["content"] for m in t.messages if m["role"] == "assistant"]


def test_qwen3_history_rewriting_is_detected(textcraft_url):
    tok = real_tokenizer("qwen3")
    fmt = ChatFormat(tok)
    assert fmt.prefix_preserving is False
    assert ChatFormat(real_tokenizer("qwen2.5-instruct")).prefix_preserving is True
    thinking = ["<think>\nI need wood.\n</think>\n\nAction: get 1 oak log",
                "<think>\nok\n</think>\n\nAction: inventory"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trajs = play(textcraft_url, tok, thinking)
    assert all(t.template == "mismatch" for t in trajs)
    assert any("differ from the chat template" in str(w.message) for w in caught)
    # the row still holds exactly what was sampled: the <think> blocks stay in the ids
    assert all(sampled_runs(t)[0]
               == in_context(fmt, t.token_ids[:t.n_prompt], thinking[0]) + [fmt.eot_id]
               for t in trajs)


def test_a_template_that_rewrites_the_reply_is_refused_when_the_format_is_made():
    """Observation turns are the template's text after a reply rendered as prompt + content; a
    template that wraps the content (in brackets; Llama-2's, in a space and eos) cannot give
    them, and says so at once, showing what it rendered."""
    from models.tiny import build_tokenizer
    tok = build_tokenizer(["user assistant U A x"], vocab_size=300)
    ChatFormat(tok)  # the tiny model's own template renders a reply as it is
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
                         "[{{ m.content }}]{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="does not render an assistant turn as prompt"):
        ChatFormat(tok)
    # Llama-2's template (written here in its form) puts a space and eos around the reply
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}"
                         "{{ '<s>[INST] ' + m.content.strip() + ' [/INST]' }}{% else %}"
                         "{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match=r"\(reply 'A' to 'U': '<s>\[INST\] U \[/INST\] A "):
        ChatFormat(tok)


def test_a_model_whose_template_cannot_mark_turns_is_one_line_and_leaves_no_run_folder(tmp_path):
    """A local --model whose chat template does not render a reply as prompt + text (here in
    Llama-2's form: a space before it, eos after) is refused at parse time, with what it
    rendered; so is one without a chat template."""
    from models.names import template_problem
    from models.tiny import build_tokenizer
    tok, out = build_tokenizer(["user assistant U A x INST"], vocab_size=300), tmp_path / "run"
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}"
                         "{{ '<s>[INST] ' + m.content.strip() + ' [/INST]' }}{% else %}"
                         "{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
    tok.save_pretrained(tmp_path / "llama2-style")
    for script in ("train.py", "eval.py", "sft.py"):
        r = run([script, "--env", "corridor", "--model", str(tmp_path / "llama2-style"),
                 "--out", str(out)])
        one_line_error(r, "does not render an assistant turn as prompt + content (reply 'A' "
                          "to 'U': '<s>[INST] U [/INST] A ")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "no-template")
    r = run(["train.py", "--env", "corridor", "--model", str(tmp_path / "no-template")])
    one_line_error(r, f"--model {tmp_path / 'no-template'}: ValueError:")
    assert not out.exists()
    tok.chat_template = "{{ raise_exception('') }}"  # an error without a message is one too
    tok.save_pretrained(tmp_path / "raises")
    assert template_problem(str(tmp_path / "raises")) == (
        f"--model {tmp_path / 'raises'}: TemplateError: ")


def test_a_template_seen_only_when_the_run_loads_it_is_one_line_too(tmp_path, monkeypatch):
    """A hub model's template is first seen when train.py's setup, eval.py or sft.py loads it:
    each refuses it in one line before writing anything (a local folder, its flag-time check turned
    off, stands in for the hub model)."""
    import models.names
    from models.tiny import build_tokenizer
    tok, out = build_tokenizer(["user assistant U A x"], vocab_size=300), tmp_path / "run"
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setattr(models.names, "template_problem", lambda folder: None)
    cfg = train.parse_args(["--env", "corridor", "--model", str(tmp_path / "model"), "--out",
                            str(out)])
    with pytest.raises(SystemExit) as e:
        train.main(cfg)
    refused = f"--model {tmp_path / 'model'}: TemplateError: roles must alternate"
    assert str(e.value) == refused and not out.exists()
    import eval as evaluation
    cfg = evaluation.parse_args(["--env", "corridor", "--model", str(tmp_path / "model"),
                                 "--out", str(tmp_path / "eval.json")])
    with pytest.raises(SystemExit) as e:
        evaluation.main(cfg)
    assert str(e.value) == refused
    from recipes import sft
    cfg = sft.parse_args(["--env", "corridor", "--model", str(tmp_path / "model"), "--out",
                          str(tmp_path / "sft")])
    with pytest.raises(SystemExit) as e:
        sft.main(cfg)
    assert str(e.value) == refused
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no run folder, eval file, sft model


def test_statuses_and_env_errors(textcraft_url):
    tok = real_tokenizer("qwen2.5-instruct")
    fmt = ChatFormat(tok)
    n_prompt = len(fmt.prompt_ids([{"role": "user", "content": "x"}]))
    _, trajs = play(textcraft_url, tok, REPLIES, max_context=n_prompt + 60, max_new_tokens=40)
    assert {t.status for t in trajs} == {"context_limit"}
    with EnvPool(textcraft_url, 2) as pool:
        rcfg = RolloutConfig(max_turns=2)
        trajs = rollout(EnginePolicy(ScriptedEngine(fmt, REPLIES), fmt, rcfg), pool, "textcraft",
                        [0, 10**6], [0, 1], rcfg, fmt=fmt)
    assert trajs[0].status == "max_turns"
    assert (trajs[1].status == "env_error" and "out of range" in trajs[1].error
            and trajs[1].token_ids == [])


def test_outcomes_leave_env_errors_out_of_the_rates():
    """An env error is no outcome of the policy's: trainer.run.outcomes (training's metrics,
    eval.py) counts it among the statuses and as an env error, and leaves it out of every rate.
    By hand, over the three episodes without one: 2 of 3 succeed, in 3 and 5 turns; 1 of 3 opens
    with a guess (the env error's guess is not counted)."""
    from env_server.agents import GUESS_THOUGHT, opening_messages, react_reply
    from rollout import Trajectory
    from trainer.run import outcomes

    def episode(status, reward, turns, thought=None):
        msgs = opening_messages("corridor", "You are at 3.") + [
            {"role": "assistant", "content": react_reply("textcraft", "inventory", thought)}]
        return Trajectory("corridor", 0, 0, msgs, [], [], [], turns=turns, status=status,
                          reward=reward)

    trajs = [episode("done", 1.0, 3, GUESS_THOUGHT), episode("env_error", 0.0, 2, GUESS_THOUGHT),
             episode("done", 1.0, 5), episode("max_turns", 0.0, 8)]
    o = outcomes(trajs)
    assert o["episodes"] == 3 and o["env_errors"] == 1
    assert o["success_rate"] == pytest.approx(2 / 3) and o["reward_mean"] == pytest.approx(2 / 3)
    assert o["turns_mean"] == pytest.approx((3 + 5 + 8) / 3) and o["turns_per_success"] == 4.0
    assert o["guess_share"] == pytest.approx(1 / 3)
    assert o["statuses"] == {"done": 2, "max_turns": 1, "context_limit": 0, "env_error": 1}
    # nothing but env errors: rates of 0 over no episode, not a division by 0
    none = outcomes([episode("env_error", 0.0, 1)])
    assert none["episodes"] == 0 and none["success_rate"] == 0.0 and none["env_errors"] == 1


def test_expert_replies_finish_with_reward(textcraft_url):
    tok = real_tokenizer("qwen2.5-instruct")
    env = TextCraftEnv(TextCraftEnv.load_world(None))
    plan = TextCraftEnv.expert_plan(env.world, 0)
    fmt, trajs = play(textcraft_url, tok, [f"Action: {a}" for a in plan], n=1, max_turns=30)
    assert trajs[0].status == "done" and trajs[0].reward == 1.0 and trajs[0].turns == len(plan)


def test_build_batch_and_log(tmp_path, textcraft_url):
    tok = real_tokenizer("qwen2.5-instruct")
    _, trajs = play(textcraft_url, tok, REPLIES, n=3)
    trajs[1].reward = 1.0
    b = build_batch(trajs, tok.pad_token_id)
    B, T = b["input_ids"].shape
    assert B == 3 and T == max(len(t.token_ids) for t in trajs)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        assert b["input_ids"][i, :n].tolist() == t.token_ids and b["attention_mask"][i].sum() == n
        assert b["loss_mask"][i, :n].tolist() == t.loss_mask and b["loss_mask"][i, n:].sum() == 0
    assert b["rewards"].tolist() == [0.0, 1.0, 0.0]
    path = tmp_path / "rollouts" / "step_000001.jsonl"
    write_log(str(path), 1, 3, trajs)
    import json
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["step"] == 1 and rows[0]["max_turns"] == 3
    assert set(rows[0]) >= {"env", "item_id", "group", "turns", "status", "reward", "messages",
                            "token_ids", "loss_mask", "logprobs"}


def test_length_buckets_keep_padding_small():
    lengths = [100, 900, 120, 880, 500, 510, 95, 905]
    buckets = length_buckets(lengths, max_tokens=2000)
    assert sorted(i for b in buckets for i in b) == list(range(8))
    for b in buckets:
        assert max(lengths[i] for i in b) * len(b) <= 2000 or len(b) == 1
    padded = sum(max(lengths[i] for i in b) * len(b) for b in buckets)
    assert (padded - sum(lengths)) / padded < 0.15


def test_hf_engine_logprobs_match_a_forward_pass(tmp_path):
    """Left padding, position ids and the KV cache: the engine's log-probs equal those of one plain
    forward pass over prompt + sample, row by row."""
    from models.tiny import build_model
    torch.manual_seed(0)
    model = build_model(vocab_size=64, layers=2, hidden=32, heads=2)
    engine = HFEngine(model, pad_id=0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    g = torch.Generator().manual_seed(0)
    samples = engine.generate(prompts, max_new_tokens=8, stop_ids=[3], temperature=0.7, generator=g)
    for p, s in zip(prompts, samples):
        assert 1 <= len(s.ids) <= 8 and s.stopped == (s.ids[-1] == 3)
        ids = torch.tensor([p + s.ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1:-1].float() / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.ids)[:, None]).squeeze(-1)
        assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4), (ref, s.logprobs)
    greedy = engine.generate(prompts, max_new_tokens=5, stop_ids=[3], temperature=0.0)
    assert greedy == engine.generate(prompts, max_new_tokens=5, stop_ids=[3], temperature=0.0)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_hf_engine_samples_with_a_generator_on_the_models_device_or_the_cpu(where):
    """train.py makes its generator on torch.device(cfg.device), "cuda" without an index, while the
    model's tensors are on "cuda:0": sampling must take it as the same device. A CPU generator
    drives a model elsewhere too. Same seed, same samples."""
    from models.tiny import build_model
    torch.manual_seed(0)
    model = build_model(vocab_size=64, layers=2, hidden=32, heads=2).to(where)
    engine = HFEngine(model, pad_id=0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    for gen_device in {torch.device(where), torch.device("cpu")}:
        draw = lambda: [s.ids for s in engine.generate(  # noqa: E731
            prompts, 6, [3], temperature=1.0, generator=torch.Generator(gen_device).manual_seed(7))]
        assert draw() == draw()


def test_fewer_tasks_than_instances_leave_the_rest_idle(textcraft_url):
    """Dynamic sampling plays fewer groups than the step's pool holds: those trajectories come back
    whole, and the other instances are neither reset nor stepped."""
    tok = real_tokenizer("qwen2.5-instruct")
    fmt = ChatFormat(tok)
    with EnvPool(textcraft_url, 4) as pool:
        rcfg = RolloutConfig(max_turns=2)
        trajs = rollout(EnginePolicy(ScriptedEngine(fmt, REPLIES), fmt, rcfg), pool, "textcraft",
                        [3, 5], [7, 7], rcfg, fmt=fmt)
        assert ([(t.item_id, t.group, t.turns, t.status) for t in trajs]
                == [(3, 7, 2, "max_turns"), (5, 7, 2, "max_turns")])


def test_play_in_chunks_counts_ended_episodes_chunk_by_chunk(textcraft_url, capsys):
    """Five episodes on two instances: three chunks, the last padded with a copy that is dropped;
    the progress bar counts episodes (not chunks) and names the chunk and turn."""
    from rollout import play_in_chunks

    class Inventory:  # a text policy: looks at its inventory until the horizon
        def replies(self, trajs, slots):
            return [Reply("Action: inventory") for _ in trajs]

    seen = []

    def play(pool, items, groups, progress):
        def spy(turn, ended, n):
            seen.append((turn, ended, n))
            progress(turn, ended, n)
        return rollout(Inventory(), pool, "textcraft", items, groups, RolloutConfig(max_turns=2),
                       progress=spy)

    trajs = play_in_chunks(textcraft_url, 2, [4, 5, 6, 7, 8], [0, 1, 2, 3, 4], play, desc="eval")
    assert ([t.item_id for t in trajs] == [4, 5, 6, 7, 8]
            and all(t.status == "max_turns" for t in trajs))
    assert seen == [(1, 0, 2), (2, 2, 2)] * 3  # every chunk, padded to the pool's two instances
    err = capsys.readouterr().err
    assert "5/5" in err and "chunk 3/3, turn 2" in err


class OneStepPool:
    """One instance whose every step ends the episode with the given value, on its server's
    scale."""

    size = 1

    def __init__(self, value):
        self.value = value

    def reset(self, item_ids):
        return ["Your task is to wait."]

    def step(self, actions):
        return [Step("Done.", self.value, True)]


class SayAction:
    def replies(self, trajs, slots):
        return [Reply("Thought: t\nAction: wait") for _ in slots]


@pytest.mark.parametrize("env,value,reward", [("sciworld", 25, 0.25), ("sciworld", 100, 1.0),
                                              ("sciworld", -100, -1.0), ("textcraft", 1.0, 1.0)])
def test_rewards_are_read_on_the_trainers_scale(env, value, reward):
    """SciWorld's server scores 0-100, as AgentGym's: the trajectory holds the score / 100."""
    t, = rollout(SayAction(), OneStepPool(value), env, [0], [0], RolloutConfig(max_turns=2))
    assert (t.status, t.reward, is_success(t)) == ("done", reward, reward > 0)


def test_a_huge_observation_is_cut_to_the_context_budget_before_it_is_tokenized():
    """1 MB of observation with 200 tokens of room: cut to what 200 tokens could hold (200 x
    CHARS_PER_TOKEN characters) and marked, so that it is never tokenized, logged or sent whole."""
    from rollout import CHARS_PER_TOKEN, Trajectory, _fit

    t = Trajectory("corridor", 0, 0, [], list(range(56)), [0] * 56, [0.0] * 56)
    text = _fit("x" * 2**20, t, RolloutConfig(max_context=256))
    assert text.startswith("x" * (200 * CHARS_PER_TOKEN) + " [... ")
    assert len(text) < 200 * CHARS_PER_TOKEN + 60 and "characters cut]" in text
    assert _fit("short", t, RolloutConfig(max_context=256)) == "short"  # what fits is left alone


class LoudPool(OneStepPool):
    """One instance whose every step answers `n` characters of observation."""

    def __init__(self, value, n, done=True):
        super().__init__(value)
        self.n, self.done = n, done

    def step(self, actions):
        return [Step("word " * (self.n // 5), self.value, self.done)]


def test_a_huge_observation_keeps_the_agents_own_words():
    """The env's text is cut before the agent wraps it: a failed attempt's 1 MB observation still
    ends with the reflect scheme's request to reflect."""
    from env_server.agents import REFLECT_ASK

    t, = rollout(SayAction(), LoudPool(0.0, 2**20), "textcraft", [0], [0],
                 RolloutConfig(max_turns=4, max_context=256), agent="reflect")
    asks = [m["content"] for m in t.messages if REFLECT_ASK in m["content"]]
    assert asks and asks[0].endswith(REFLECT_ASK) and "characters cut]" in asks[0]


def test_a_row_never_passes_the_context_limit():
    """An observation within the character budget but past the tokens left: the row is cut at
    --max-context (nothing after its last reply is trained on) and ends there."""
    tok = real_tokenizer("qwen2.5-instruct")
    fmt = ChatFormat(tok)
    rcfg = RolloutConfig(max_turns=3, max_context=512, max_new_tokens=16)
    policy = EnginePolicy(ScriptedEngine(fmt, ["Thought: t\nAction: wait"]), fmt, rcfg)
    t, = rollout(policy, LoudPool(0.0, 12_000, done=False), "textcraft", [0], [0], rcfg, fmt=fmt)
    assert t.status == "context_limit" and len(t.token_ids) == 512 and sum(t.loss_mask) > 0
    assert len(t.loss_mask) == len(t.logprobs) == 512


def test_a_group_whose_only_other_score_is_an_env_error_is_not_informative():
    """Two wins and an env error: the error is no score (not a 0), so the group is tied."""
    from rollout import Trajectory, informative_groups

    def t(group, status, reward):
        return Trajectory("corridor", 0, group, [], [], [], [], status=status, reward=reward)

    trajs = [t(0, "done", 1.0), t(0, "done", 1.0), t(0, "env_error", 0.0),
             t(1, "done", 1.0), t(1, "max_turns", 0.0)]
    assert informative_groups(trajs) == {1}


def test_a_partial_score_at_the_horizon_is_no_success_anywhere():
    """An episode cut at K with a partial score above 0 (SciWorld gives them) is no success: not
    for rollout.is_success, not in outcomes' success rate, not in eval.py's Pass@n."""
    import eval as ev
    from rollout import Trajectory, is_success
    from trainer.run import outcomes

    cut = Trajectory("sciworld", 7, 0, [], [], [], [], status="max_turns", reward=0.35)
    won = Trajectory("sciworld", 7, 0, [], [], [], [], status="done", reward=1.0)
    assert not is_success(cut) and is_success(won)
    assert outcomes([cut, won])["success_rate"] == 0.5
    table = ev.scores([(0, 7, 0), (0, 7, 1)], [cut, cut], {7: "a"})
    assert table["overall"]["pass@2"] == 0.0 and table["overall"]["avg@2"] == 0.35
