"""FastHFEngine: hf_engine.HFEngine, the same samples from the same distribution, faster on long
multi-turn conversations. What the training and evaluation scripts, SFT and bench build for
`--engine hf` (`engines.make_engine(..., hf_class=FastHFEngine)`).

What it adds to the plain sampler (bench/turn_cache.py measures the last two, off against on):
- a static KV cache of fixed size written in place (a growing cache is re-concatenated at every
  token, which costs more than the model itself once prompts are a few thousand tokens long);
- the cache kept across turns (`reuse=True`): a prompt that extends one of the previous call's
  rows starts from that row's keys and values, so a turn encodes only the new observation;
- row compaction: once half of the rows being decoded have stopped, the others go on alone.
"""

from __future__ import annotations

import torch

from hf_engine import HFEngine, Sample, cut_at_stop, keeps_last_logits, left_pad, sample


class FastHFEngine(HFEngine):
    """HFEngine with a static cache, the cache kept across turns and row compaction.

    Turns share their conversation so far. With `reuse=True`, a prompt that extends one of the
    previous call's rows (its prompt and sampled ids) starts from that row's keys and values.
    rollout() asks for this and calls `forget()` at the end; the kept cache is also dropped when
    the weights change in place (an optimizer step bumps the tensors' version counter) or are
    synced. `static_cache=False` and `compact=False` turn a feature off; bench/turn_cache.py
    compares compaction off and on, and reuse off (`reuse_ok = False`) and on.
    """

    def __init__(self, model, pad_id: int, max_batch: int = 64, static_cache: bool = True,
                 compact: bool = True):
        super().__init__(model, pad_id, max_batch)
        self.static_cache = static_cache
        self.compact = compact  # decode only the rows still generating once half have stopped
        self.decoded_rows = 0  # rows computed over all decoding steps (compaction: < steps x rows)
        self._kept = None  # the previous call's cache and rows, for reuse=True
        self.reuse_ok = True  # False once the cache's layout is not the one _seed knows
        # prompt tokens taken from the kept cache / encoded (bench/turn_cache.py prints them)
        self.reused_tokens = self.encoded_tokens = 0

    @property
    def dtype(self) -> torch.dtype:
        """What it samples in: its model's (VLLMEngine's is the --dtype it was started with)."""
        return next(self.model.parameters()).dtype

    def forget(self) -> None:
        """Drop the cache kept for the next turn."""
        self._kept = None

    def _weights_version(self) -> tuple:
        return tuple(p._version for p in self.model.parameters())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, reuse: bool = False) -> list[Sample]:
        """Per batch of `max_batch` prompts: the prompts left-padded into one block (prefill, from
        the kept cache where a prompt extends a kept row), then one token per row per model call
        until every row has sampled a stop id (decode), then each row cut after its stop id. With
        `reuse`, the rows are kept for the next turn."""
        reuse = reuse and self.reuse_ok and self.static_cache
        kept, self._kept = self._kept, None
        if not reuse or (kept is not None and kept["version"] != self._weights_version()):
            kept = None  # not asked for, or the weights changed since: the kept cache is stale
        out, rows = [], []
        was_training = self.model.training
        self.model.eval()
        try:
            for i in range(0, len(prompts), self.max_batch):
                chunk = prompts[i:i + self.max_batch]
                step, cache = self._prefill(chunk, max_new_tokens, kept)
                new_ids, new_lps = self._decode(step, cache, max_new_tokens, stop_ids,
                                                temperature, top_p, generator)
                got = cut_at_stop(new_ids, new_lps, stop_ids)
                out += got
                if reuse and rows is not None and hasattr(step["cache"], "layers"):
                    # every id but the last sampled one went through the model: its keys and
                    # values are in the cache
                    rows += [{"seq": p + s.ids, "valid": len(p) + len(s.ids) - 1,
                              "cache": step["cache"], "b": b, "start": step["starts"][b]}
                             for b, (p, s) in enumerate(zip(chunk, got))]
                else:
                    rows = None  # not asked for, or a cache that cannot be kept
        finally:
            self.model.train(was_training)
        if reuse and rows is not None:
            self._kept = {"rows": rows, "version": self._weights_version()}
        return out

    def _static_cache(self, length: int):
        """transformers' StaticCache of `length` positions, or None (a growing cache) where it
        fails."""
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
        """For each prompt, (kept row, tokens reusable) or (-1, 0). Rows come back in the same
        order, less the finished ones, so a forward scan finds them."""
        found, j = [], 0
        for p in prompts:
            hit = (-1, 0)
            for k in range(j, len(rows)):
                seq, valid = rows[k]["seq"], rows[k]["valid"]
                # at least one prompt token is encoded: it yields the logits
                n = min(valid, len(p) - 1)
                if n > 0 and p[:n] == seq[:n]:
                    hit, j = (k, n), k + 1
                    break
            found.append(hit)
        return found

    def _seed(self, cache, rows: list[dict], hits, starts, first_slot: int) -> bool:
        """Write into `cache` (a fresh StaticCache), for each prompt with a hit, the kept keys and
        values of its reused tokens at the prompt's own slots; False where the cache's layout is
        not the one expected (then every prompt is encoded in full)."""
        try:
            B = len(hits)
            for layer_i, new_layer in enumerate(cache.layers):
                for b, (r, n) in enumerate(hits):
                    if r < 0:
                        continue
                    old_layer = rows[r]["cache"].layers[layer_i]
                    src, old_b = rows[r]["start"], rows[r]["b"]
                    k, v = old_layer.keys, old_layer.values
                    if not new_layer.is_initialized:
                        new_layer.lazy_initialization(k[:1].expand(B, -1, -1, -1),
                                                      v[:1].expand(B, -1, -1, -1))
                    new_layer.keys[b, :, starts[b]:starts[b] + n] = k[old_b, :, src:src + n]
                    new_layer.values[b, :, starts[b]:starts[b] + n] = v[old_b, :, src:src + n]
                if not new_layer.is_initialized:
                    return False
                new_layer.cumulative_length.fill_(first_slot)
            return True
        except (AttributeError, TypeError, RuntimeError, IndexError):  # another cache layout
            self.reuse_ok = False
            return False

    def _prefill(self, prompts, max_new_tokens, kept):
        """The first model call's inputs: prompts left-padded so that every row's next token goes at
        column L, and the cache, seeded with the kept keys and values of reused prefixes when there
        are any."""
        device = next(self.model.parameters()).device
        ids, attn, pos = left_pad(prompts, self.pad_id, device)
        L = ids.shape[1]
        starts = [L - len(p) for p in prompts]
        # Encode columns [first, L): all of them, or only those past the longest reused prefix's
        # end. A row whose reuse ends earlier re-encodes a few of its kept tokens, to the same keys
        # and values.
        first, cache = 0, self._static_cache(L + max_new_tokens)
        if kept is not None and cache is not None:
            hits = self._matches(prompts, kept["rows"])
            first = L - max(len(p) - n for p, (_, n) in zip(prompts, hits))
            if first > 0 and not self._seed(cache, kept["rows"], hits, starts, first):
                first, cache = 0, self._static_cache(L + max_new_tokens)  # a clean one
        self.reused_tokens += sum(first - s for s in starts if s < first)
        self.encoded_tokens += sum(L - max(s, first) for s in starts)
        step = {"ids": ids[:, first:], "pos": pos[:, first:], "attn": attn, "cache": cache,
                "starts": starts, "cache_pos": torch.arange(first, L, device=device)}
        return step, cache

    def _decode(self, step, cache, max_new_tokens, stop_ids, temperature, top_p, generator):
        """Model calls until every row has sampled a stop id or max_new_tokens: (B, n) ids and their
        sampler log-probs; a row that has stopped samples pad from then on.

        Once half of the rows being computed have stopped, the others go on alone (`_Compacted`:
        their keys and values move to a smaller cache, and back at the end): a reply that runs to
        max_new_tokens no longer keeps every finished row in each model call. Sampling still draws
        for all B rows (a stopped row draws from a uniform row and is discarded), so each row's
        sampling stream is the one it would have had without compaction."""
        device = step["ids"].device
        stop = torch.tensor(stop_ids, device=device)
        B = step["ids"].shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        ids, pos, attn, cache_pos = step["ids"], step["pos"], step["attn"], step["cache_pos"]
        keep_last = keeps_last_logits(self.model)
        new_ids, new_lps = [], []
        live = _Compacted(cache, B, device) if self.compact and B > 1 else None
        for _ in range(max_new_tokens):
            kw = {} if cache is None else {"cache_position": cache_pos}
            # the LM head on the last position only: a prompt's other logits are never read, and
            # with a 49k-token vocabulary they cost a fifth of a prefill
            if keep_last:
                kw["logits_to_keep"] = 1
            o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                           past_key_values=cache, use_cache=True, **kw)
            cache = step["cache"] = o.past_key_values
            cache_pos = cache_pos[-1:] + 1
            logits = o.logits[:, -1].float()
            self.decoded_rows += logits.shape[0]
            if live is not None and live.rows is not None:  # stopped rows: uniform, discarded
                logits = logits.new_zeros(B, logits.shape[-1]).index_copy_(0, live.rows, logits)
            nxt, lp = sample(logits, temperature, top_p, generator)
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


class _Compacted:
    """The rows of a decoding batch still being computed. `rows` (None: all B) are their indices in
    the batch; `shrink` drops the stopped ones once they are half of those computed, moving the
    others' keys and values into a smaller copy of each cache layer; `restore` writes the computed
    rows back into the full layers (a stopped row's slots after its stop keep what they held:
    nothing reads them) and puts them back, so that the cache can be kept for the next turn. A
    cache whose layers hold no `keys`/`values` tensors is never compacted."""

    def __init__(self, cache, B: int, device):
        self.cache, self.B, self.device = cache, B, device
        self.rows, self.full = None, None  # full: each layer's (keys, values) of all B rows

    def _compactable(self) -> bool:
        # read when first needed: a static cache allocates its tensors on its first call
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(
            isinstance(getattr(x, "keys", None), torch.Tensor) and x.keys.shape[0] == self.B
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
