"""Multi-turn rollouts, token in / token out.

One trajectory = one env instance playing one task for up to K assistant turns. All unfinished
trajectories generate together, then their envs step together (one batched HTTP call), then each
observation is appended. The row of token ids of a trajectory is built by appending, never re-encoding:

    prompt ids (chat template of the opening messages, with the generation prompt)
    + sampled ids of turn 1 (loss mask 1, sampler log-probs kept), ending with the end-of-turn token
    + observation ids (the chat template's rendering of the user turn, loss mask 0)
    + sampled ids of turn 2 ... and so on.

So the ids trained on are exactly the ids the sampler produced and saw. Every turn the row is checked
against the chat template of the messages so far: equal ids (the usual case), or equal text with a
different but valid tokenization of sampled text (`noncanonical`), or different text (`mismatch`): a
template that rewrites history (Qwen3 drops earlier <think> blocks; `ChatFormat.prefix_preserving` tells
in advance), or a tokenizer whose decode/encode is not an exact round trip. A mismatch is reported
loudly and counted; the row still holds what the policy saw, which is what it is trained on.

Statuses (DESIGN.md): done, max_turns, context_limit, env_error. An env error drops the trajectory from
the loss; it is never scored as 0.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from agents import Move, make_agent
from env_client import EnvError, EnvPool

# ---------------------------------------------------------------- chat template, as token deltas
class ChatFormat:
    """What to append after a sampled reply, read off the tokenizer's own chat template.

    The template is rendered on a fixed dummy conversation [user U, assistant A, user OBS] and the
    text after "A" is the observation turn: the end-of-turn marker, the user turn, the generation
    prompt. Its first token is the end-of-turn token the policy samples to end its reply.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use an instruct/chat model's tokenizer")
        self.tok = tokenizer
        anchor = self.encode(self._after_reply("x"))
        first = anchor[0] if anchor else None
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        # The end-of-turn token: the first token after the reply if it is a special token (<|im_end|>,
        # <|end|>); otherwise replies end at the tokenizer's eos.
        self.eot_id = first if first in special else tokenizer.eos_token_id
        self.stop_ids = sorted({i for i in (self.eot_id, tokenizer.eos_token_id) if i is not None})
        self.eot_is_anchor = first in special
        self.prefix_preserving = self._check_prefix_preserving()

    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _after_reply(self, observation: str) -> str:
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        head = self._render(base[:1], gen=True) + "A"
        full = self._render(base + [{"role": "user", "content": observation}], gen=True)
        if not full.startswith(head):
            raise ValueError("the chat template does not render an assistant turn as prompt + content; "
                             "cannot build observation turns from it")
        return full[len(head):]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, gen=True))

    def reply_ids(self, reply: str) -> list[int]:
        """A reply written as text (an expert's), as ids the policy would sample: tokenised in place after
        the generation prompt, as the full template tokenises it (SentencePiece tokenisers encode a
        text's first word differently at the start of a string), then the end-of-turn token."""
        head = self._render([{"role": "user", "content": "U"}], gen=True)
        h, full = self.encode(head), self.encode(head + reply)
        ids = full[len(h):] if full[:len(h)] == h else self.encode(reply)
        return ids + [self.eot_id]

    def observation_ids(self, observation: str, reply_ended: bool) -> list[int]:
        """Ids to append after a reply: the end-of-turn token (unless the policy sampled it), the user
        turn with `observation`, and the generation prompt. Tokenised with the end-of-turn special token
        in front, as inside the full template, so boundaries match."""
        ids = self.encode(self._after_reply(observation))
        if reply_ended and self.eot_is_anchor:
            ids = ids[1:]
        return ids

    def _check_prefix_preserving(self) -> bool:
        """Does rendering a longer conversation keep the shorter one as its prefix, reasoning included?"""
        msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"}]
        short = self._render(msgs, gen=False)
        eos = self.tok.eos_token or ""
        if eos and short.endswith(eos):  # Phi-3 ends a finished conversation with eos
            short = short[: -len(eos)]
        return self._render(msgs + [{"role": "user", "content": "Q2"}], gen=True).startswith(short)


# ---------------------------------------------------------------- generation engines
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

    def __init__(self, model, pad_id: int, max_batch: int = 64, static_cache: bool = True):
        self.model, self.pad_id, self.max_batch, self.static_cache = model, pad_id, max_batch, static_cache
        self._kept = None  # the previous call's cache and rows, for reuse=True
        self.reuse_ok = True  # False once the cache's layout turned out not to be the one _seeded_cache knows
        self.reused_tokens = self.encoded_tokens = 0  # prompt tokens taken from the kept cache / encoded

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
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token goes at column L
            ids[b, L - len(p):] = torch.tensor(p)
            attn[b, L - len(p):] = 1
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(stop_ids, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        new_ids, new_lps = [], []
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
        step_ids, step_pos, cache_pos = ids[:, first:], pos[:, first:], torch.arange(first, L, device=device)
        for _ in range(max_new_tokens):
            kw = {} if cache is None else {"cache_position": cache_pos}
            o = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos, past_key_values=cache,
                      use_cache=True, **kw)
            cache = o.past_key_values
            cache_pos = cache_pos[-1:] + 1
            logits = o.logits[:, -1].float()  # (B, V)
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
            lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            new_ids.append(nxt)
            new_lps.append(lp)
            done = done | torch.isin(nxt, stop)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # finished rows: ignored
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
        model.train(was_training)
        new_ids_t, new_lps_t = torch.stack(new_ids, 1).cpu(), torch.stack(new_lps, 1).cpu()
        stop_set = set(stop_ids)
        out = []
        for b in range(B):
            ids_b, lps_b = [], []
            for t in range(new_ids_t.shape[1]):
                tok = int(new_ids_t[b, t])
                ids_b.append(tok)
                lps_b.append(float(new_lps_t[b, t]))
                if tok in stop_set:
                    break
            out.append(Sample(ids_b, lps_b, bool(ids_b) and ids_b[-1] in stop_set))
        rows = None
        if self.static_cache and cache is not None and hasattr(cache, "layers"):
            # every id but the last sampled one went through the model: its keys and values are in the cache
            rows = [{"seq": p + s.ids, "valid": len(p) + len(s.ids) - 1, "cache": cache, "b": b, "start": starts[b]}
                    for b, (p, s) in enumerate(zip(prompts, out))]
        return out, rows


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (nucleus sampling)."""
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


class VLLMEngine:
    """Batched sampling with vLLM on a GPU, in the training process, with weights pushed in place.

    The same contract as HFEngine: token ids in (vLLM's `TokensPrompt`), sampled ids and their sampler
    log-probs out, the stop token kept; no text is decoded or encoded. Written against vLLM 0.33
    (requirements-gpu.txt); vllm is imported here, never when rollout.py is.

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

    In-process weights. `distributed_executor_backend="external_launcher"` is vLLM's executor for engines
    started by torchrun-like launchers: it turns V1 multiprocessing off, so the engine core and its one
    worker live in this process (one engine per rank; RANK, WORLD_SIZE, ... are set here when no
    launcher did). `LLM.apply_model(f)` then runs f on the worker's model with no serialisation, and f
    calls vLLM's own checkpoint loader, `model.load_weights([(HF name, tensor), ...])`, which maps HF
    names onto vLLM's fused weights (qkv_proj, gate_up_proj) and skips a tied lm_head. This is the
    colocate mode of TRL. vLLM's RLHF examples (examples/rl/rlhf_ipc.py, the "ipc" weight-transfer
    backend) are for an engine in another process (a Ray actor, an HTTP server) and ship CUDA IPC
    handles of the trainer's tensors; in-process there is nothing to ship.

    Memory. `enable_sleep_mode=True`: `sleep()` (level 1) copies the weights to CPU and frees the KV
    cache while the trainer updates; `sync_weights` wakes the weights only (the KV cache stays free
    while gathered buckets are alive) and `generate` wakes the rest. Level 2 would drop the CPU copy,
    but a level-2 engine holds garbage until every weight is reloaded (vllm-project/vllm#29341), a
    failure that shows only as bad samples.
    """

    TAGS = ("kv_cache", "weights")  # vLLM's sleep-mode memory tags

    def __init__(self, model_path: str, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 seed: int = 0, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
                 bucket_bytes: int = 1 << 30, **llm_kwargs):
        vllm = self._import_vllm()
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)  # what torchrun sets; external_launcher reads them
        if "MASTER_PORT" not in os.environ:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        self.vllm, self.bucket_bytes = vllm, bucket_bytes
        self.dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # None ("auto"): no cast
        self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, max_model_len=max_model_len,
                            seed=seed, enable_prefix_caching=True,  # turns share their conversation so far
                            enable_sleep_mode=True, distributed_executor_backend="external_launcher",
                            logprobs_mode="processed_logprobs", generation_config="vllm", **llm_kwargs)
        self._asleep: set[str] = set()
        self._warned_top_p = False

    @staticmethod
    def _import_vllm():
        try:
            import vllm
        except ImportError as e:
            raise ImportError("--engine vllm needs vLLM, which is not installed here: "
                              "pip install -r requirements-gpu.txt on a CUDA machine (or use --engine hf)") from e
        return vllm

    # -------- memory: vLLM sleep mode
    def sleep(self) -> None:
        """Free the GPU for the update: weights to CPU, KV cache dropped (vLLM sleep level 1)."""
        if self._asleep == set(self.TAGS):
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

        Call after each optimizer step, on every rank (gathering a sharded tensor is a collective). The
        state dict is walked in order, each FSDP2 shard (a DTensor) gathered with `full_tensor()`, cast to
        the engine's dtype, and handed to vLLM's loader in buckets of about `bucket_bytes`: one call per
        bucket, not per parameter, and at most one bucket of gathered tensors alive. Nothing touches
        disk. The prefix cache is reset afterwards: its KV was computed by the old weights.
        """
        from torch.distributed.tensor import DTensor

        t0 = time.perf_counter()
        self.wake_up(["weights"])
        bucket, size = [], 0
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t = t.full_tensor()
            t = t.detach() if self.dtype is None else t.detach().to(self.dtype)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                self._load(bucket)
                bucket, size = [], 0
        if bucket:
            self._load(bucket)
        if self.llm.reset_prefix_cache() is False:  # older vLLMs return None
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running?): KV computed with "
                               "the old weights would be reused")
        return time.perf_counter() - t0

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        def load(vllm_model):
            return vllm_model.load_weights(weights)

        self.llm.apply_model(load)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies have run before the caller frees this bucket


def make_engine(kind: str, model, model_path: str, pad_id: int, **vllm_kwargs):
    """The generation engine for --engine `kind`. "hf": HFEngine sampling with the trainer's own `model`
    (`vllm_kwargs` are ignored). "vllm": a colocated VLLMEngine loaded from `model_path`, a folder with the
    same weights as `model` (they are pushed again by `sync_weights` after each update); `vllm_kwargs` go
    to VLLMEngine (gpu_memory_utilization, max_model_len, seed, ...)."""
    if kind == "hf":
        return HFEngine(model, pad_id)
    if kind == "vllm":
        return VLLMEngine(model_path, **vllm_kwargs)
    raise ValueError(f"unknown engine {kind!r}: choose hf or vllm")


# ---------------------------------------------------------------- trajectories
@dataclass
class Trajectory:
    env: str
    item_id: int
    group: int
    messages: list[dict]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: int = 0
    status: str = "running"
    reward: float = 0.0
    template: str = "exact"  # exact | noncanonical | mismatch (see the module docstring)
    error: str | None = None
    n_prompt: int = 0  # ids of the opening prompt
    agent: str = "react"  # the scheme that played it (agents.SCHEMES)

    @property
    def finished(self) -> bool:
        return self.status != "running"


def check_against_template(fmt: ChatFormat, t: Trajectory) -> str:
    """exact: the row is the template's ids; noncanonical: same text, another valid tokenisation of
    sampled text; mismatch: the template renders these messages as other text."""
    text = fmt._render(t.messages, gen=True)
    if fmt.encode(text) == t.token_ids:
        return "exact"
    decoded = fmt.tok.decode(t.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return "noncanonical" if decoded == text else "mismatch"


@dataclass
class RolloutConfig:
    max_turns: int = 10  # assistant turns (the scheduler's horizon K)
    max_new_tokens: int = 64  # per turn
    max_context: int = 4096  # tokens per trajectory
    temperature: float = 1.0
    top_p: float = 1.0
    check_template: bool = True  # compare each row to the chat template every turn


def start_trajectories(pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
                       agents: list | None = None) -> list[Trajectory]:
    """Reset pool instance i to task item_ids[i]; one Trajectory each with its agent's opening messages
    (default: react), or status env_error when the reset failed."""
    assert len(item_ids) == pool.size == len(groups)
    agents = agents or [make_agent("react", env, 0) for _ in item_ids]
    trajs = []
    for item, group, first, agent in zip(item_ids, groups, pool.reset(list(item_ids)), agents):
        t = Trajectory(env, item, group, [], [], [], [], agent=agent.name)
        if isinstance(first, EnvError):
            t.status, t.error = "env_error", str(first)
        else:
            t.messages = agent.opening(first)
        trajs.append(t)
    return trajs


def play_moves(pool: EnvPool, trajs: list[Trajectory], agents: list, moves: dict[int, Move], max_turns: int) -> None:
    """One turn's env side, for the trajectories that replied (moves[i] from agents[i].act): the actions
    go to the env in one batched call; then each trajectory gets its next user message (the agent's
    rendering of the env's answer, or its note where there was no step), its reward and status; where the
    agent retries, the env is reset to the same task and the reward starts again from 0."""
    results = pool.step([moves[i].action if i in moves else None for i in range(pool.size)])
    retry = []
    for i, move in moves.items():
        t, agent, r = trajs[i], agents[i], results[i]
        if isinstance(r, EnvError):
            t.status, t.error = "env_error", str(r)
            continue
        if move.action is None:
            text, outcome = agent.observe(move.note, None, False, t.turns)
        else:
            t.reward = r.reward
            text, outcome = agent.observe(r.observation, r.reward, r.done, t.turns)
        t.messages.append({"role": "user", "content": text})
        if outcome == "done":
            t.status = "done"
        elif outcome == "retry":
            retry.append(i)
        elif t.turns >= max_turns:
            t.status = "max_turns"
    if retry:
        firsts = pool.reset([trajs[i].item_id if i in retry else None for i in range(pool.size)])
        for i in retry:
            if isinstance(firsts[i], EnvError):
                trajs[i].status, trajs[i].error = "env_error", str(firsts[i])
            else:
                agents[i].restart(firsts[i])
                trajs[i].reward = 0.0


def rollout(engine, fmt: ChatFormat, pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
            cfg: RolloutConfig, generator: torch.Generator | None = None, progress=None,
            agent: str = "react") -> list[Trajectory]:
    """Play `item_ids[i]` in pool instance i, all at once, until every trajectory has ended; `agent`
    names the scheme (agents.SCHEMES)."""
    agents = [make_agent(agent, env, cfg.max_turns) for _ in item_ids]
    trajs = start_trajectories(pool, env, item_ids, groups, agents)
    for t in trajs:
        if not t.finished:
            t.token_ids = fmt.prompt_ids(t.messages)
            t.n_prompt = len(t.token_ids)
            t.loss_mask = [0] * len(t.token_ids)
            t.logprobs = [0.0] * len(t.token_ids)

    for turn in range(cfg.max_turns):
        for t in trajs:  # the next reply must fit: stop before generating, not in the middle
            if not t.finished and len(t.token_ids) + cfg.max_new_tokens > cfg.max_context:
                t.status = "context_limit"
        active = [i for i, t in enumerate(trajs) if not t.finished]
        if not active:
            break
        samples = engine.generate([trajs[i].token_ids for i in active], cfg.max_new_tokens, fmt.stop_ids,
                                  cfg.temperature, cfg.top_p, generator, reuse=True)
        moves = {}
        for i, s in zip(active, samples):
            t = trajs[i]
            t.token_ids += s.ids
            t.loss_mask += [1] * len(s.ids)
            t.logprobs += s.logprobs
            t.turns += 1
            body = s.ids[:-1] if s.stopped else s.ids
            reply = fmt.tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            t.messages.append({"role": "assistant", "content": reply})
            moves[i] = agents[i].act(reply)
        play_moves(pool, trajs, agents, moves, cfg.max_turns)
        for i, s in zip(active, samples):
            t = trajs[i]
            if t.finished:
                continue
            t.token_ids += (obs_ids := fmt.observation_ids(t.messages[-1]["content"], s.stopped))
            t.loss_mask += [0] * len(obs_ids)
            t.logprobs += [0.0] * len(obs_ids)
            if cfg.check_template and t.template != "mismatch":
                t.template = _worse(t.template, check_against_template(fmt, t))
            if len(t.token_ids) >= cfg.max_context:
                t.status = "context_limit"
        if progress is not None:
            progress(turn + 1, sum(t.finished for t in trajs), len(trajs))
    engine.forget()  # the conversations are over: free the cache kept for their next turn
    for t in trajs:
        if not t.finished:
            t.status = "max_turns"
    mismatched = sum(t.template == "mismatch" for t in trajs)
    if mismatched:
        why = ("this template rewrites history (e.g. Qwen3 drops earlier <think> blocks)"
               if not fmt.prefix_preserving else "decode/encode is not a round trip for this tokenizer")
        warnings.warn(f"{mismatched}/{len(trajs)} rows differ from the chat template's rendering of their "
                      f"messages: {why}. Rows keep the ids the policy saw, and those are trained on.", stacklevel=2)
    return trajs


def _worse(a: str, b: str) -> str:
    order = ["exact", "noncanonical", "mismatch"]
    return order[max(order.index(a), order.index(b))]


# ---------------------------------------------------------------- training batch
def build_batch(trajs: list[Trajectory], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for the trainer; env errors are left out by the caller.

    input_ids, attention_mask, position_ids, loss_mask, old_logprobs: (B, T), aligned so that
    loss_mask[b, t] = 1 means token t was sampled by the policy with log-prob old_logprobs[b, t]
    given tokens < t. rewards: (B,) outcome rewards; the trainer puts each on the row's last sampled
    token (algos.token_rewards_from_outcome).
    """
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    lps = torch.zeros((B, T), dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    pos = torch.arange(T).expand(B, T).clone()
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t.group for t in trajs], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": mask,
            "old_logprobs": lps, "rewards": rewards, "group_ids": groups}


def length_buckets(lengths: list[int], max_tokens: int, overhead_tokens: int | None = None) -> list[list[int]]:
    """Split row indices into micro-batches of similar length, each with rows x longest <= max_tokens
    (a row longer than that gets its own batch), minimising padded tokens plus `overhead_tokens` per
    micro-batch (a forward pass has a fixed cost; default max_tokens / 16). Rows sorted by length make
    each batch a contiguous run, so a short dynamic programme finds the best cut points."""
    overhead = max_tokens // 16 if overhead_tokens is None else overhead_tokens
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    L = [lengths[i] for i in order]
    n = len(L)
    prefix = [0]
    for x in L:
        prefix.append(prefix[-1] + x)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of batching the j longest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # batch = sorted rows i..j-1; its longest is L[i]
            if L[i] * (j - i) > max_tokens and j - i > 1:
                break
            cost = best[i] + L[i] * (j - i) - (prefix[j] - prefix[i]) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


# ---------------------------------------------------------------- trajectory log
def write_log(path: str, step: int, max_turns: int, trajs: list[Trajectory]) -> None:
    """OUT/rollouts/step_000042.jsonl: one JSON object per trajectory (DESIGN.md's format)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for t in trajs:
            d = asdict(t)
            d.update(step=step, max_turns=max_turns)
            f.write(json.dumps(d) + "\n")
    os.replace(tmp, path)


__all__ = ["ChatFormat", "HFEngine", "RolloutConfig", "Sample", "Trajectory", "VLLMEngine", "build_batch",
           "length_buckets", "make_engine", "play_moves", "rollout", "start_trajectories", "write_log"]
