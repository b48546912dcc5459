"""HFEngine: a plain batched sampler with a KV cache on any transformers causal LM, CPU or GPU.
The trainer's own model generates, so there are no weights to copy after an update. `Sample` is
what every engine returns (engines.py picks one; vllm_engine.py has the other; models/fast_hf.py
is this sampler with the cache kept across turns and finished rows dropped from decoding)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    ids: list[int]  # sampled ids, including the stop token when one was sampled
    logprobs: list[float]  # sampler log-prob of each sampled id
    stopped: bool  # ended on a stop token (False: hit max_new_tokens)


class HFEngine:
    """The prompts left-padded into one block and encoded at once (prefill), then one token per
    row per model call (decode), earlier positions' keys and values read from the cache. Log-probs
    are those of the tempered distribution, log softmax(logits / temperature), before top-p
    truncation: the trainer computes its own the same way, so the PPO ratio is 1 on-policy."""

    def __init__(self, model, pad_id: int, max_batch: int = 64):
        self.model, self.pad_id, self.max_batch = model, pad_id, max_batch

    def sync_weights(self, model) -> float:
        self.model = model  # same process, same object: nothing to copy
        self.forget()
        return 0.0

    def forget(self) -> None:
        """Nothing is kept between calls here (FastHFEngine drops its kept cache)."""

    def sleep(self) -> None:
        """Nothing to free: the trainer's own model generates (VLLMEngine has the same methods)."""
        self.forget()

    def wake_up(self) -> None:
        """See sleep."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 1.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, reuse: bool = False) -> list[Sample]:
        """Samples for `prompts`, `max_batch` rows per model call. `reuse` is a hint for engines
        that keep the conversation's cache between turns; this one encodes every prompt in full."""
        out = []
        for i in range(0, len(prompts), self.max_batch):
            out += self._batch(prompts[i:i + self.max_batch], max_new_tokens, stop_ids,
                               temperature, top_p, generator)
        return out

    def _batch(self, prompts, max_new_tokens, stop_ids, temperature, top_p, generator):
        """One model call over all the prompts (prefill), then one per new token (decode) until
        every row has sampled a stop id or max_new_tokens; each row cut after its stop id."""
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            ids, attn, pos = left_pad(prompts, self.pad_id, next(self.model.parameters()).device)
            stop = torch.tensor(stop_ids, device=ids.device)
            done = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
            # the LM head on the last position only, where the model allows it: the prompt's
            # other logits are never read, and over a large vocabulary they cost a lot of memory
            kw = {"logits_to_keep": 1} if keeps_last_logits(self.model) else {}
            cache, new_ids, new_lps = None, [], []
            for _ in range(max_new_tokens):
                o = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                               past_key_values=cache, use_cache=True, **kw)
                cache = o.past_key_values
                nxt, lp = sample(o.logits[:, -1].float(), temperature, top_p, generator)
                # a row that has stopped samples pad from then on (cut_at_stop drops it)
                nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
                new_ids.append(nxt)
                new_lps.append(lp)
                done = done | torch.isin(nxt, stop)
                if bool(done.all()):
                    break
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
                ids, pos = nxt[:, None], pos[:, -1:] + 1
        finally:
            self.model.train(was_training)
        return cut_at_stop(torch.stack(new_ids, 1).cpu(), torch.stack(new_lps, 1).cpu(), stop_ids)


def keeps_last_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (most of transformers' LMs do)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def left_pad(prompts: list[list[int]], pad_id: int, device):
    """(ids, attention mask, position ids), each (B, L): every prompt ends at column L - 1, so
    every row's next token goes at column L; positions count from each prompt's first token."""
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


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 logits (B, V), and its log-prob under log softmax(logits / T),
    before top-p truncation (the trainer's side computes the same); temperature 0 is greedy."""
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    if temperature <= 0:
        nxt = logp.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        if generator is not None and generator.device.type != probs.device.type:
            # a CPU generator driving a model elsewhere: draw on the CPU (slower, same stream)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
            nxt = nxt.to(probs.device)
        else:
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (nucleus sampling)."""
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)
