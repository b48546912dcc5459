"""HFEngine: `--engine hf`'s batched sampler, on any transformers causal LM, CPU or GPU.
The trainer's own model generates: no weights to copy after an update. `Sample` is what
every engine returns (engines.py picks one; vllm_engine.py has the other).

One call: the prompts left-padded into one block, encoded at once (prefill), then one token
per row per model call (decode) until every row has sampled a stop id. Two things speed up
long multi-turn conversations without changing a sample (bench/turn_cache.py times each):
- The cache kept across turns. A turn's prompt is the previous one, its reply and the new
  observation. With `reuse=True` (rollout() asks for it) each call keeps its rows' ids and
  keys and values; the next call copies a kept row's keys and values into the new cache at
  the columns of the prompt that extends it, and encodes only the columns past them. It is
  transformers' StaticCache, allocated once per call and written in place (a growing cache
  is re-concatenated at every token: more than the model costs on long prompts).
- Finished rows dropped: once half of the decoded rows have stopped, the others go on alone.
Both write into the cache's layers, so the engine checks once, when built, that each knows
the layers: a model transformers has no StaticCache for samples with a growing cache and
neither; reuse needs plain StaticLayers (a sliding window's rolls its columns), compaction
those or sliding windows (hybrid or indexed-attention layers hold more than keys, values).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

import algos  # the sampler's rule: a token and its log-prob (algos.sample_token)


@dataclass
class Sample:
    ids: list[int]  # sampled ids, including the stop token when one was sampled
    logprobs: list[float]  # sampler log-prob of each sampled id
    stopped: bool  # ended on a stop token (False: hit max_new_tokens)


class HFEngine:
    """Log-probs are the tempered distribution's, log softmax(logits / T), before top-p
    truncation: the trainer computes its own alike, so the PPO ratio is 1 on-policy.
    `static_cache=False` (a growing cache: no reuse) and `compact=False` turn a feature off.
    The methods are VLLMEngine's; `sync_weights` has nothing to copy, `sleep` drops the kept
    KV cache (`forget`)."""

    def __init__(self, model, pad_id: int, max_batch: int = 64, static_cache: bool = True,
                 compact: bool = True):
        self.model, self.pad_id, self.max_batch = model, pad_id, max_batch
        kinds = _static_layer_types(model) if static_cache else set()
        self.static_cache = bool(kinds)
        # the features the cache's layers allow (module docstring); bench/turn_cache.py turns
        # reuse_ok or compact off to time one
        self.reuse_ok = kinds == {StaticLayer}
        self.compact = (compact and self.static_cache
                        and kinds <= {StaticLayer, StaticSlidingWindowLayer})
        # the LM head on the last position only, where the model allows it: a prompt's other
        # logits are never read (with a 49k-token vocabulary: a fifth of a prefill's cost)
        self.forward_kw = {}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            self.forward_kw["logits_to_keep"] = 1
        self._kept = None  # the previous call's rows, for reuse=True
        # prompt tokens taken from the kept cache / encoded, and rows computed over all decode
        # steps (under steps x rows with compaction): bench/turn_cache.py prints them
        self.reused_tokens = self.encoded_tokens = self.decoded_rows = 0

    @property
    def dtype(self) -> torch.dtype:
        """What it samples in: its model's dtype (VLLMEngine's: the --dtype it was given)."""
        return next(self.model.parameters()).dtype

    def sync_weights(self, model) -> float:
        self.model = model  # the one it was built with (same process): nothing to copy
        self.forget()
        return 0.0

    def forget(self) -> None:
        """Drop the rows kept for the next turn."""
        self._kept = None

    sleep = forget

    def wake_up(self) -> None:
        """Nothing to bring back (see sleep)."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None,
                 reuse: bool = False) -> list[Sample]:
        """Samples for `prompts`, `max_batch` rows per model call. `reuse` keeps the rows for
        the next call (rollout() calls forget() at the end), unless the weights change."""
        reuse = reuse and self.reuse_ok
        version = [p._version for p in self.model.parameters()]  # an optimizer step bumps it
        kept, self._kept = self._kept, None
        if not reuse or (kept is not None and kept["version"] != version):
            kept = None
        out, rows = [], []
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            for i in range(0, len(prompts), self.max_batch):
                chunk = prompts[i:i + self.max_batch]
                got, cache, starts = self._batch(chunk, max_new_tokens, stop_ids, temperature,
                                                 top_p, generator, kept)
                out += got
                # row b's ids but the last sampled one went through the model: their keys and
                # values are in `cache`, row b, from column starts[b] on
                if reuse:
                    rows += [{"ids": p + s.ids, "valid": len(p) + len(s.ids) - 1,
                              "cache": cache, "b": b, "start": starts[b]}
                             for b, (p, s) in enumerate(zip(chunk, got))]
        finally:
            self.model.train(was_training)
        if reuse:
            self._kept = {"rows": rows, "version": version}
        return out

    def _batch(self, prompts, max_new_tokens, stop_ids, temperature, top_p, generator, kept):
        """Prefill past the kept rows' columns, then a model call per token until all rows
        stop or hit max_new_tokens -> (samples cut after their stop, cache, prompt starts)."""
        device = next(self.model.parameters()).device
        ids, attn, pos = left_pad(prompts, self.pad_id, device)
        B, L = ids.shape
        starts = [L - len(p) for p in prompts]
        cache, first = None, 0
        if self.static_cache:
            cache = StaticCache(config=self.model.config, max_cache_len=L + max_new_tokens)
        if kept is not None:
            # encode columns [first, L) only; a row whose reuse ends before `first` encodes
            # again a few of its kept tokens, to the same keys and values
            hits = _matches(prompts, kept["rows"])
            first = min(s + n for s, (_, n) in zip(starts, hits))
            if first > 0:
                _seed(cache, kept["rows"], hits, starts, first)
        self.reused_tokens += sum(first - s for s in starts if s < first)
        self.encoded_tokens += sum(L - max(s, first) for s in starts)
        ids, pos = ids[:, first:], pos[:, first:]
        kw = {"cache_position": torch.arange(first, L, device=device), **self.forward_kw}
        live = _Compacted(cache, B) if self.compact and B > 1 else None
        stop = torch.tensor(stop_ids, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        new_ids, new_lps = [], []
        for _ in range(max_new_tokens):
            o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                           past_key_values=cache, use_cache=True, **kw)
            cache = o.past_key_values
            logits = o.logits[:, -1].float()
            self.decoded_rows += logits.shape[0]
            if live is not None and live.rows is not None:
                # stopped rows were not computed: they draw from a uniform row, discarded, so
                # that every row keeps the sampling stream it has without compaction
                every_row = logits.new_zeros(B, logits.shape[-1])
                logits = every_row.index_copy_(0, live.rows, logits)
            nxt, lp = algos.sample_token(logits, temperature, top_p, generator)
            # a row that has stopped samples pad from then on (cut_at_stop drops it)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            new_ids.append(nxt)
            new_lps.append(lp)
            done = done | torch.isin(nxt, stop)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            ids, pos = nxt[:, None], pos[:, -1:] + 1
            kw["cache_position"] = kw["cache_position"][-1:] + 1
            if live is not None:
                ids, pos, attn = live.shrink(done, ids, pos, attn)
        if live is not None:
            live.restore()
        samples = cut_at_stop(torch.stack(new_ids, 1).cpu(), torch.stack(new_lps, 1).cpu(),
                              stop_ids)
        return samples, cache, starts


def _matches(prompts: list[list[int]], rows: list[dict]) -> list[tuple[int, int]]:
    """For each prompt, (kept row, tokens reusable) or (-1, 0). Rows come back in the same
    order, less the finished ones, so a forward scan finds them."""
    found, j = [], 0
    for p in prompts:
        hit = (-1, 0)
        for k in range(j, len(rows)):
            # at least one prompt token is encoded: it yields the logits
            n = min(rows[k]["valid"], len(p) - 1)
            if n > 0 and p[:n] == rows[k]["ids"][:n]:
                hit, j = (k, n), k + 1
                break
        found.append(hit)
    return found


def _seed(cache, rows: list[dict], hits, starts, first: int) -> None:
    """Write into `cache` (a fresh StaticCache), for each prompt with a hit, the kept keys and
    values of its reused tokens at the prompt's own columns."""
    for i, layer in enumerate(cache.layers):
        for b, (r, n) in enumerate(hits):
            if r < 0:
                continue
            old, src, old_b = rows[r]["cache"].layers[i], rows[r]["start"], rows[r]["b"]
            if not layer.is_initialized:  # allocated like the kept one, for B rows
                layer.lazy_initialization(old.keys[:1].expand(len(hits), -1, -1, -1),
                                          old.values[:1].expand(len(hits), -1, -1, -1))
            layer.keys[b, :, starts[b]:starts[b] + n] = old.keys[old_b, :, src:src + n]
            layer.values[b, :, starts[b]:starts[b] + n] = old.values[old_b, :, src:src + n]
        layer.cumulative_length.fill_(first)  # where the prefill's keys go


def _static_layer_types(model) -> set[type]:
    """The classes of the layers of a StaticCache for `model`: none where transformers has no
    StaticCache for it."""
    try:
        return {type(x) for x in StaticCache(config=model.config, max_cache_len=1).layers}
    except Exception:  # a model transformers' StaticCache does not support
        return set()


class _Compacted:
    """The rows of a decoding batch still computed, `rows` (None: all B). Once half of them
    have stopped, `shrink` moves the others' keys and values into a smaller copy of each cache
    layer; `restore` writes them back into the full layers, kept for the next turn (a stopped
    row's columns after its stop keep what they held: nothing reads them)."""

    def __init__(self, cache, B: int):
        self.layers, self.B = cache.layers, B
        self.rows = self.full = None  # full: each layer's (keys, values) of all B rows

    def shrink(self, done, ids, pos, attn):
        """The next model call's inputs, from `ids` for all B rows and `pos`, `attn` for the
        rows computed so far."""
        if self.rows is None:
            rows = torch.arange(self.B, device=ids.device)
        else:
            rows, ids = self.rows, ids[self.rows]
        keep = (~done[rows]).nonzero().squeeze(1)
        if len(keep) > len(rows) // 2:
            return ids, pos, attn
        if self.full is None:
            self.full = [(x.keys, x.values) for x in self.layers]
        else:  # the computed rows back into the full layers (as `restore`), then a new selection
            for x, (k, v) in zip(self.layers, self.full):
                k.index_copy_(0, self.rows, x.keys)
                v.index_copy_(0, self.rows, x.values)
        self.rows = rows[keep]
        for x, (k, v) in zip(self.layers, self.full):
            x.keys, x.values = k.index_select(0, self.rows), v.index_select(0, self.rows)
        return ids[keep], pos[keep], attn[keep]

    def restore(self):
        if self.full is None:
            return
        for x, (k, v) in zip(self.layers, self.full):
            k.index_copy_(0, self.rows, x.keys)
            v.index_copy_(0, self.rows, x.values)
            x.keys, x.values = k, v


def left_pad(prompts: list[list[int]], pad_id: int, device):
    """(ids, attention mask, position ids), each (B, L): every prompt ends at column L - 1, so
    every row's next token goes at column L; positions count from each prompt's start."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        attn[b, L - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def cut_at_stop(new_ids: torch.Tensor, new_lps: torch.Tensor, stop_ids) -> list[Sample]:
    """Each row's ids up to and including its first stop id (the pads after it dropped)."""
    stop_set, out = set(stop_ids), []
    for ids_row, lps_row in zip(new_ids.tolist(), new_lps.tolist()):
        n = next((t + 1 for t, tok in enumerate(ids_row) if tok in stop_set), len(ids_row))
        out.append(Sample(ids_row[:n], lps_row[:n], n > 0 and ids_row[n - 1] in stop_set))
    return out
