"""The policy: loading a model and its tokenizer, the critic, token log-probs, FSDP sharding.

Everything that touches the model's weights and is shared by train.py, eval.py, recipes/sft.py
and the warm start lives here; where a model comes from (a folder, a hub name, a built-in
name) is models/builtin.py.

- `load_tokenizer` / `pad_id`: one pad rule for every script: the tokenizer's pad token, else
  its eos.
- `load_model`: an HF causal LM on a device, in float32 unless asked otherwise.
- `resolve_dtype`: --dtype auto|fp32|bf16 (with bf16 a copy computes while the optimizer keeps
  the fp32 master weights: distributed.py's `Precision`).
- `Critic`: a value head on a copy of the policy's transformer body (PPO).
- `token_logprobs`: algos.token_logprobs (the trainer's log-probs) for the recipes and bench.
- `shard_model`: FSDP2 sharding under torchrun.
"""

from __future__ import annotations

import types

import torch

import algos
from distributed import world_size


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def pad_id(tokenizer) -> int:
    """The id padded rows are filled with (attention masks hide it): the tokenizer's pad
    token, else its eos token."""
    pid = tokenizer.pad_token_id
    if pid is None:
        pid = tokenizer.eos_token_id
    if pid is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad rows with")
    return pid


def load_model(path: str, device="cpu", dtype: torch.dtype | None = torch.float32):
    """An HF causal LM from the folder `path`, on `device`, cast to `dtype` (None: the
    checkpoint's own). A grouped-query model (fewer key/value heads than query heads, as
    SmolLM2 and Qwen have) attends with `grouped_sdpa`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar, once a load, says nothing
    model = AutoModelForCausalLM.from_pretrained(path).to(device=device, dtype=dtype)
    cfg = model.config
    if getattr(cfg, "num_key_value_heads", None) and \
            cfg.num_key_value_heads < cfg.num_attention_heads and \
            cfg._attn_implementation == "sdpa":
        _register_grouped_sdpa()
        model.set_attn_implementation("grouped_sdpa")
    return model


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX): there a bf16
    matrix product runs 4-6x faster than fp32; elsewhere bf16 is emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:  # not Linux: no way to tell cheaply, so no
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


from engines import MIN_BF16_PARAMS  # noqa: E402
# (below it, matrices are too small for bf16 to pay)


def resolve_dtype(name: str, device, model: torch.nn.Module | None = None) -> torch.dtype:
    """--dtype: `fp32`, `bf16`, or `auto`: bf16 on CUDA and on CPUs with native bf16
    (cpu_has_bf16) for a model of at least MIN_BF16_PARAMS parameters, fp32 otherwise."""
    if name == "auto":
        kind = torch.device(device).type
        fast = kind == "cuda" or (kind == "cpu" and cpu_has_bf16())
        big = model is None or sum(p.numel() for p in model.parameters()) >= MIN_BF16_PARAMS
        return torch.bfloat16 if fast and big else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected auto, fp32 or bf16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as vLLM takes it and runs and evaluations record it."""
    return str(dtype).removeprefix("torch.")


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling=None, **kw):
    """transformers' SDPA attention for grouped-query models, without copying the keys and
    values out to every query head. With a padding mask, transformers repeats each key/value
    head for its query heads (`repeat_kv`) at every call: in decoding that copies the whole
    cache, every layer, every token. Here the query heads that share a key/value head become
    extra query rows of that head instead (query head h uses key/value head h // groups), and
    the mask's rows are tiled to match: the same attention, computed on the cache as it is.
    Without a mask, transformers' own path already avoids the copy (SDPA's enable_gqa). query
    (B, H, q, d), key/value (B, Hkv, k, d) -> (B, q, H, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 \
            or attention_mask.shape[1] != 1 or kw.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kw)
    B, H, q, d = query.shape
    # row g * q + t: query head (kv head, g) at position t
    rows = query.reshape(B, H // groups, groups * q, d)
    mask = (attention_mask.repeat(1, 1, groups, 1) if attention_mask.shape[2] == q
            else attention_mask)
    # (B, Hkv, groups * q, d)
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None


def _register_grouped_sdpa() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register("grouped_sdpa", grouped_sdpa)
    AttentionMaskInterface.register("grouped_sdpa", sdpa_mask)  # the masks SDPA takes


class Critic(torch.nn.Module):
    """A value head on a copy of the policy's transformer body: V(prefix) per position."""

    def __init__(self, path: str):
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path)
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids).last_hidden_state
        # (B, T, 1); a bf16 body may feed an fp32 head
        v = self.head(h.to(self.head.weight.dtype))
        # (B, T); not a view, which FSDP warns about as a module's output
        return v.squeeze(-1).float().clone()


def prepare(m: torch.nn.Module, device, grad_checkpointing: bool = False,
            dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model for the trainer: activations recomputed in the backward with
    `grad_checkpointing`; on the device in float32 (master weights, whatever the checkpoint's
    dtype: bf16 weights would round most small updates away; `Precision` gives the bf16 copy
    that computes); under torchrun sharded at once, so that no more than one full copy is ever
    on a GPU, FSDP computing in `dtype` on CUDA."""
    if grad_checkpointing:
        (m.body if isinstance(m, Critic) else m).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    m = m.to(device=device, dtype=torch.float32)
    return shard_model(m, device, dtype) if world_size() > 1 else m


def token_logprobs(model, mb: dict, temperature: float, with_entropy: bool = False,
                   mask=None):
    """algos.token_logprobs, in this module's argument order (recipes/sft.py, the warm start,
    bench)."""
    return algos.token_logprobs(model, mb, temperature, mask=mask, with_entropy=with_entropy)


def shard_model(module: torch.nn.Module, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """FSDP2, in place: each decoder layer is a unit whose weights are all-gathered just
    before it runs and freed after it (and again in the backward), then the root (embeddings,
    final norm, LM head or value head), which keeps its weights from the forward to the
    backward. On CUDA the units compute in `dtype` (bf16 unless --dtype fp32) from fp32 master
    shards and reduce gradients in fp32; on CPU everything is fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)

    mesh = init_device_mesh(device.type, (world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
          if device.type == "cuda" and dtype != torch.float32 else MixedPrecisionPolicy())
    layer_classes = set().union(*(getattr(m, "_no_split_modules", None) or ()
                                  for m in module.modules()))
    layers = [m for m in module.modules()
              if type(m).__name__ in layer_classes and m is not module]
    for m in layers:
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    has_lm_head = (hasattr(module, "get_output_embeddings")
                   and module.get_output_embeddings() is not None)
    if has_lm_head:
        module.masked_logits = types.MethodType(algos.masked_logits, module)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if hasattr(module, "masked_logits"):
        register_fsdp_forward_method(module, "masked_logits")
    return module


