"""VLLMEngine (engines.py): the code path against a stand-in `vllm` module on CPU (token ids in, ids and
tempered log-probs out, the stop token kept, sleep/wake, bucketed in-place weight sync), and against real
vLLM on a CUDA GPU (sampler log-probs equal the trainer's, a sync changes what is sampled)."""

import importlib.util
import math
import os
import socket
import sys
import types

import pytest
import torch

import engines
from engines import HFEngine, Sample, VLLMEngine, make_engine

ENGINES_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engines.py")


# ---------------------------------------------------------------- a stand-in for the vllm package
class FakeVLLM:
    """The parts of vLLM's API VLLMEngine uses, with vLLM's signatures (keyword names, defaults) and its
    behaviour on a toy model: logits are a fixed function of the context, sampling honours temperature,
    top_p, seed, stop_token_ids, ignore_eos and max_tokens, and `logprobs_mode` decides which log-probs come
    back. Wrong calls raise, as vLLM's would: an unknown keyword, a text prompt, generating or writing
    weights while asleep."""

    VOCAB, EOS = 16, 15
    LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

    def __init__(self):
        self.module = types.ModuleType("vllm")
        self.module.LLM = self._llm_class()
        self.module.SamplingParams = FakeSamplingParams
        self.module.TokensPrompt = fake_tokens_prompt
        self.llms = []

    @staticmethod
    def logits(context: list[int]) -> torch.Tensor:
        v = torch.arange(FakeVLLM.VOCAB, dtype=torch.float64)
        return 3.0 * torch.sin(1.3 * v + 0.7 * len(context) + 0.1 * sum(context))

    def _llm_class(fake):
        class LLM:
            def __init__(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                         gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                         enable_prefix_caching: bool | None = None, enable_sleep_mode: bool = False,
                         distributed_executor_backend: str | None = None, logprobs_mode: str = "raw_logprobs",
                         generation_config: str = "auto", enforce_eager: bool = False):
                assert isinstance(model, str)
                assert logprobs_mode in FakeVLLM.LOGPROBS_MODES, logprobs_mode
                assert distributed_executor_backend in (None, "mp", "ray", "uni", "external_launcher")
                if distributed_executor_backend == "external_launcher":
                    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                        assert k in os.environ, f"external_launcher needs {k}"
                self.kwargs = dict(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                   enable_prefix_caching=enable_prefix_caching, enable_sleep_mode=enable_sleep_mode,
                                   distributed_executor_backend=distributed_executor_backend,
                                   logprobs_mode=logprobs_mode, generation_config=generation_config)
                self.sleeping: set[str] = set()
                self.log: list[str] = []
                self.loaded: dict[str, torch.Tensor] = {}
                self.load_calls: list[list[str]] = []
                self.seen_params: list[FakeSamplingParams] = []
                self.rng = torch.Generator().manual_seed(seed)
                fake.llms.append(self)

            def sleep(self, level: int = 1, mode: str = "abort") -> None:
                assert self.kwargs["enable_sleep_mode"], "sleep() needs enable_sleep_mode=True"
                assert level in (0, 1, 2)
                self.log.append(f"sleep{level}")
                self.sleeping = {"weights", "kv_cache"}

            def wake_up(self, tags: list[str] | None = None) -> None:
                assert tags is None or (isinstance(tags, list) and set(tags) <= {"weights", "kv_cache", "scheduling"})
                self.log.append("wake_up" if tags is None else "wake_up:" + ",".join(tags))
                self.sleeping -= {"weights", "kv_cache"} if tags is None else set(tags)

            def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
                self.log.append("reset_prefix_cache")
                return True

            def apply_model(self, func):
                if "weights" in self.sleeping:
                    raise RuntimeError("weights written while offloaded to CPU")
                return [func(FakeVLLMModel(self))]

            def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
                if self.sleeping:
                    raise RuntimeError(f"generate while {sorted(self.sleeping)} sleep")
                assert isinstance(prompts, list) and prompts
                params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
                assert len(params) == len(prompts)
                self.log.append("generate")
                outs = []
                for prompt, sp in zip(prompts, params):
                    assert isinstance(sp, FakeSamplingParams)
                    assert isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}, "token ids only"
                    self.seen_params.append(sp)
                    outs.append(self._one(list(prompt["prompt_token_ids"]), sp))
                return outs

            def _one(self, context, sp):
                gen = self.rng if sp.seed is None else torch.Generator().manual_seed(sp.seed)
                ids, lps, finish = [], [], "length"
                for _ in range(sp.max_tokens):
                    logits = FakeVLLM.logits(context)
                    if sp.temperature > 0:
                        logits = logits / sp.temperature
                        probs = torch.softmax(logits, -1)
                        if sp.top_p < 1:
                            probs = engines._top_p_filter(probs, sp.top_p)
                            logits = torch.where(probs > 0, logits, torch.tensor(-math.inf, dtype=logits.dtype))
                        tok = int(torch.multinomial(probs.float(), 1, generator=gen))
                    else:
                        tok = int(logits.argmax())
                    mode = self.kwargs["logprobs_mode"]
                    raw = FakeVLLM.logits(context)
                    values = {"raw_logprobs": torch.log_softmax(raw, -1), "raw_logits": raw,
                              "processed_logprobs": torch.log_softmax(logits, -1), "processed_logits": logits}[mode]
                    if sp.logprobs is not None:
                        top = values.topk(sp.logprobs).indices.tolist() if sp.logprobs else []
                        lps.append({t: FakeLogprob(float(values[t])) for t in top + [tok]})
                    ids.append(tok)
                    context = context + [tok]
                    if tok in (sp.stop_token_ids or []) or (tok == FakeVLLM.EOS and not sp.ignore_eos):
                        finish = "stop"  # vLLM keeps the stop token in token_ids
                        break
                return types.SimpleNamespace(outputs=[types.SimpleNamespace(
                    token_ids=ids, logprobs=lps if sp.logprobs is not None else None, finish_reason=finish)])

        return LLM


class FakeSamplingParams:
    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 max_tokens: int | None = 16, logprobs: int | None = None, detokenize: bool = True):
        assert n == 1 and 0 < top_p <= 1 and temperature >= 0 and max_tokens >= 1
        assert logprobs is None or logprobs >= 0
        assert seed is None or (isinstance(seed, int) and 0 <= seed < 2**63)
        self.__dict__.update(n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, max_tokens=max_tokens,
                             logprobs=logprobs, detokenize=detokenize)


def fake_tokens_prompt(*, prompt_token_ids):
    assert isinstance(prompt_token_ids, list) and all(isinstance(t, int) for t in prompt_token_ids)
    return {"prompt_token_ids": prompt_token_ids}


class FakeLogprob:
    def __init__(self, logprob: float):
        self.logprob, self.rank, self.decoded_token = logprob, 1, None


class FakeVLLMModel:
    """The worker's model as `apply_model` hands it over: only `load_weights` is used."""

    def __init__(self, llm):
        self.llm = llm

    def load_weights(self, weights):
        names = []
        for name, t in weights:
            assert isinstance(name, str) and type(t) is torch.Tensor, (name, type(t))
            assert name not in self.llm.loaded, f"{name} pushed twice"
            self.llm.loaded[name] = t.clone()
            names.append(name)
        self.llm.load_calls.append(names)
        self.llm.log.append("load")
        return set(names)


@pytest.fixture
def fake_vllm(monkeypatch):
    fake = FakeVLLM()
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # setenv then delenv: undone at teardown even where it was unset, so
        monkeypatch.delenv(k)  # what the engine sets (as a launcher would) does not leak into other tests
    return fake


def tempered_logprobs(prompt, sample_ids, temperature):
    """What HFEngine returns for these ids under the fake's logits: log softmax(logits / T), before top-p."""
    out, ctx = [], list(prompt)
    for tok in sample_ids:
        logits = FakeVLLM.logits(ctx)
        out.append(float(torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)[tok]))
        ctx.append(tok)
    return out


# ---------------------------------------------------------------- without vllm
def test_module_imports_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    spec = importlib.util.spec_from_file_location("engines_without_vllm", ENGINES_PY)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    assert hasattr(mod, "VLLMEngine") and hasattr(mod, "make_engine")


def test_make_engine_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install -r requirements-gpu\.txt on a CUDA machine"):
        make_engine("vllm", torch.nn.Linear(2, 2), "/no/such/model", pad_id=0)


def test_make_engine_hf_and_unknown():
    model = torch.nn.Linear(2, 2)
    engine = make_engine("hf", model, "/unused", pad_id=3, gpu_memory_utilization=0.3)
    assert isinstance(engine, HFEngine) and engine.model is model and engine.pad_id == 3
    assert engine.sync_weights(model) == 0.0
    engine.sleep(), engine.wake_up()  # no-ops, so train.py calls them whatever the engine
    with pytest.raises(ValueError, match="hf or vllm"):
        make_engine("sglang", model, "/unused", pad_id=0)


# ---------------------------------------------------------------- the code path, on the stand-in
def test_engine_construction(fake_vllm):
    engine = make_engine("vllm", None, "/models/tiny", pad_id=0, gpu_memory_utilization=0.3, max_model_len=512,
                         seed=7)
    assert isinstance(engine, VLLMEngine)
    kw = fake_vllm.llms[0].kwargs
    assert kw == dict(model="/models/tiny", tensor_parallel_size=1, dtype="bfloat16", seed=7,
                      gpu_memory_utilization=0.3, max_model_len=512, enable_prefix_caching=True,
                      enable_sleep_mode=True, distributed_executor_backend="external_launcher",
                      logprobs_mode="processed_logprobs", generation_config="vllm")
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generate_token_ids_and_tempered_logprobs(fake_vllm, temperature):
    engine = VLLMEngine("/models/tiny")
    stop = [3, 9]
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 10], [1, 2, 3]] * 4
    out = engine.generate(prompts, 8, stop, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert len(out) == len(prompts) and all(isinstance(s, Sample) for s in out)
    for p, s in zip(prompts, out):
        assert 1 <= len(s.ids) <= 8 and len(s.logprobs) == len(s.ids)
        assert not set(s.ids[:-1]) & set(stop), "generation goes on past a stop token"
        assert s.stopped == (s.ids[-1] in stop)
        if not s.stopped:
            assert len(s.ids) == 8
        assert s.logprobs == pytest.approx(tempered_logprobs(p, s.ids, temperature), abs=1e-6)
    assert any(s.stopped for s in out) and any(not s.stopped for s in out)
    assert any(FakeVLLM.EOS in s.ids[:-1] for s in out), "eos outside stop_ids must not end a reply"
    sp = fake_vllm.llms[0].seen_params[0]
    assert sp.logprobs == 0 and sp.detokenize is False and sp.ignore_eos is True and sp.stop_token_ids == stop


def test_generate_seeds_reproducible_and_distinct_per_request(fake_vllm):
    engine = VLLMEngine("/models/tiny")
    prompts = [[1, 2]] * 6  # a group: the same prompt G times
    a = engine.generate(prompts, 6, [3], generator=torch.Generator().manual_seed(1))
    b = engine.generate(prompts, 6, [3], generator=torch.Generator().manual_seed(1))
    assert [s.ids for s in a] == [s.ids for s in b]
    seeds = [sp.seed for sp in fake_vllm.llms[0].seen_params[:6]]
    assert len(set(seeds)) == 6, "copies of a prompt need their own seeds, or a group samples one reply G times"
    assert len({tuple(s.ids) for s in a}) > 1
    gen = torch.Generator().manual_seed(1)
    engine.generate(prompts, 6, [3], generator=gen)
    c = engine.generate(prompts, 6, [3], generator=gen)  # the generator moved on: new seeds
    assert [s.ids for s in c] != [s.ids for s in a]
    engine.generate(prompts, 6, [3])  # no generator: vLLM's own seeded RNG
    assert all(sp.seed is None for sp in fake_vllm.llms[0].seen_params[-6:])


def test_generate_greedy_and_top_p(fake_vllm):
    engine = VLLMEngine("/models/tiny")
    prompts = [[1, 2], [7]]
    g = engine.generate(prompts, 5, [3], temperature=0.0, generator=torch.Generator().manual_seed(0))
    assert all(sp.temperature == 0.0 for sp in fake_vllm.llms[0].seen_params)
    for p, s in zip(prompts, g):
        ctx = list(p)
        for tok in s.ids:
            assert tok == int(FakeVLLM.logits(ctx).argmax())
            ctx.append(tok)
        assert s.logprobs == pytest.approx(tempered_logprobs(p, s.ids, 0.0), abs=1e-6)
    with pytest.warns(UserWarning, match="nucleus"):
        engine.generate(prompts, 5, [3], top_p=0.5)
    assert engine.generate([], 5, [3]) == []


def test_sleep_wake_order(fake_vllm):
    engine = VLLMEngine("/models/tiny")
    llm = fake_vllm.llms[0]
    engine.generate([[1]], 2, [3])
    engine.sleep()
    engine.sleep()  # idempotent
    with pytest.raises(RuntimeError):  # the stand-in refuses to generate while asleep ...
        llm.generate([{"prompt_token_ids": [1]}], FakeSamplingParams())
    engine.generate([[1]], 2, [3])  # ... so the engine must wake itself
    assert llm.log == ["generate", "sleep1", "wake_up", "generate"]


def test_sync_weights_in_buckets(fake_vllm):
    engine = VLLMEngine("/models/tiny", bucket_bytes=10_000)
    llm = fake_vllm.llms[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])  # 16 KiB fp32 per weight
    engine.generate([[1]], 2, [3])
    engine.sleep()
    seconds = engine.sync_weights(model)
    assert isinstance(seconds, float) and seconds >= 0
    sd = model.state_dict()
    assert sorted(llm.loaded) == sorted(sd), "every tensor of the state dict pushed exactly once, by HF name"
    assert [n for call in llm.load_calls for n in call] == list(sd), "in state-dict order"
    assert len(llm.load_calls) > 1, "bucketed, not one call for the whole model"
    assert len(llm.load_calls) < len(sd), "bucketed, not one call per tensor"
    for name, t in sd.items():
        assert llm.loaded[name].dtype == torch.bfloat16 and torch.equal(llm.loaded[name], t.to(torch.bfloat16))
    # weights woken alone for the copy, the prefix cache reset after the last bucket, the KV cache
    # woken by the next generate
    assert llm.log[:3] == ["generate", "sleep1", "wake_up:weights"]
    assert llm.log[3:] == ["load"] * len(llm.load_calls) + ["reset_prefix_cache"]
    engine.generate([[1]], 2, [3])
    assert llm.log[-2:] == ["wake_up:kv_cache", "generate"]
    engine.sleep()  # the next step: all asleep again
    assert llm.log[-1] == "sleep1" and llm.sleeping == {"weights", "kv_cache"}


def test_sync_weights_gathers_dtensors(fake_vllm):
    """An FSDP2 model's state dict holds DTensors: each is gathered with full_tensor() before loading."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        model = types.SimpleNamespace(state_dict=lambda: dict(sharded))
        VLLMEngine("/models/tiny", dtype="float32").sync_weights(model)
    finally:
        dist.destroy_process_group()
    loaded = fake_vllm.llms[0].loaded
    assert sorted(loaded) == sorted(full)
    for k, v in full.items():
        assert torch.equal(loaded[k], v)


# ---------------------------------------------------------------- real vLLM on a GPU
def _why_no_gpu_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -r requirements-gpu.txt on a CUDA machine)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


needs_gpu_vllm = pytest.mark.skipif(_why_no_gpu_vllm() is not None, reason=_why_no_gpu_vllm() or "")


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    """A tiny random Llama saved as an HF folder, its HF model on the GPU, and a VLLMEngine on the folder."""
    from tiny_model import build_model, build_tokenizer

    path = str(tmp_path_factory.mktemp("tiny_vllm"))
    tok = build_tokenizer(["Thought: I will get 2 oak log.\nAction: get 2 oak log"] * 20, vocab_size=300)
    model = build_model(len(tok), layers=2, hidden=128, heads=2)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # peaked logits, so that temperature visibly matters
    tok.save_pretrained(path)
    model.save_pretrained(path)
    model = model.cuda().eval()
    engine = VLLMEngine(path, gpu_memory_utilization=0.2, max_model_len=256, seed=0, enforce_eager=True)
    return engine, model, tok


def trainer_logprobs(model, prompt, ids, temperature):
    """The trainer's view: one forward pass over prompt + ids in float32, log softmax(logits / T)."""
    x = torch.tensor([prompt + ids], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)
    return logp.gather(-1, torch.tensor(ids, device="cuda")[:, None]).squeeze(-1).cpu()


@needs_gpu_vllm
def test_real_vllm_logprobs_match_trainer(real_engine):
    engine, model, tok = real_engine
    prompts = [tok("Action: get")["input_ids"], tok("Thought:")["input_ids"]] * 4
    T = 0.6
    out = engine.generate(prompts, 24, [tok.eos_token_id], temperature=T, generator=torch.Generator().manual_seed(0))
    err_tempered, err_raw = [], []
    for p, s in zip(prompts, out):
        assert s.ids and len(s.logprobs) == len(s.ids)
        vllm_lp = torch.tensor(s.logprobs)
        err_tempered.append((vllm_lp - trainer_logprobs(model, p, s.ids, T)).abs())
        err_raw.append((vllm_lp - trainer_logprobs(model, p, s.ids, 1.0)).abs())
    err_tempered, err_raw = torch.cat(err_tempered), torch.cat(err_raw)
    # bf16 engine vs float32 trainer: close, and much closer to the tempered than to the raw distribution
    assert err_tempered.mean() < 0.05 and err_tempered.max() < 0.3, err_tempered
    assert err_tempered.mean() < err_raw.mean() / 4


@needs_gpu_vllm
def test_real_vllm_sync_weights_changes_samples(real_engine):
    engine, model, tok = real_engine
    prompts = [tok("Action: get")["input_ids"]] * 2
    before = engine.generate(prompts, 16, [tok.eos_token_id], temperature=0.0)
    engine.sleep()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    seconds = engine.sync_weights(model)
    assert seconds > 0
    after = engine.generate(prompts, 16, [tok.eos_token_id], temperature=0.0)
    assert [s.ids for s in after] != [s.ids for s in before]
    # same prompt as before the sync: a stale prefix cache would give the old weights' log-probs
    for p, s in zip(prompts, after):
        assert (torch.tensor(s.logprobs) - trainer_logprobs(model, p, s.ids, 0.0)).abs().max() < 0.3
