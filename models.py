"""Where a policy comes from: `resolve(model, env, cache_dir)` turns the scripts' --model into a folder.

- absent: the built-in tiny model for the env, warm-started (warmstart.py) and cached stage by stage;
- a local folder: used as it is;
- a Hugging Face hub name: loaded from the local cache, or downloaded; an unknown name, or a hub that
  cannot be reached, is refused at once (`check_model`), before a run folder exists.
"""

from __future__ import annotations

import os
import shutil

import warmstart


# The built-in tiny models, per env: (tokenizer kind, layers, hidden size). Corridor's policy starts from
# random weights with a word-level vocabulary (its learning test); the others are warm-started (warmstart.py).
TINY_MODELS = {"corridor": ("words", 2, 64)}
TINY_DEFAULT = ("bpe", 3, 192)


def build_once(path: str, build) -> str:
    """Call build(tmp_dir) once and move the result to `path`; concurrent callers keep one winner."""
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + f".tmp{os.getpid()}"
        build(tmp)
        if os.path.exists(path):  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
    return path


def tiny_model_path(env: str, cache_dir: str) -> str:
    """The built-in tiny model for this env with random weights, built once into the cache folder."""
    import tiny_model

    kind, layers, hidden = TINY_MODELS.get(env, TINY_DEFAULT)
    os.makedirs(cache_dir, exist_ok=True)
    return build_once(os.path.join(cache_dir, f"tiny-{env}-{kind}-{layers}x{hidden}-mha"), lambda tmp: tiny_model.build(
        tmp, env_names=(env,), tokenizer=kind, layers=layers, hidden=hidden))


def default_model_path(env: str, cache_dir: str) -> str:
    """The policy the scripts use without --model: the tiny model after the env's warm start
    (warmstart.WARM_START: copying, then behavioural cloning on a deliberately noisy expert, then, with
    `guess`, a guessing or stalling habit), built once and cached, stage by stage; the random tiny model
    for envs without a recipe."""
    base = tiny_model_path(env, cache_dir)
    recipe = warmstart.WARM_START.get(env)
    if recipe is None:
        return base
    tag = "-".join(f"{k}{v}" for k, v in sorted(recipe.items()) if k not in warmstart.GUESS_KEYS)
    path = f"{base}-warm-{tag}"
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"building the warm-started tiny model for {env} (once; cached in {path})", flush=True)
        steps = recipe.get("copy_steps", 0)
        if steps:  # stage 1 has its own folder: a change to the rest of the recipe reuses it
            base = build_once(f"{base}-copy{steps}", lambda tmp: warmstart.copy_stage(env, base, tmp, steps))
    path = build_once(path, lambda tmp: warmstart.warm_start(env, base, tmp))
    if "guess" not in recipe:
        return path
    keys = [f"{k}{recipe[k]}".replace(" ", "_") for k in warmstart.GUESS_KEYS if k in recipe]
    guess_path = path + "-guess-" + "-".join(keys)
    if not os.path.exists(os.path.join(guess_path, "config.json")):
        print(f"building stage 3 of the {env} warm start, its habit (once; cached in {guess_path})", flush=True)
    return build_once(guess_path, lambda tmp: warmstart.guess_stage(env, path, tmp))


def check_model(model: str | None) -> str | None:
    """Why --model `model` cannot be loaded, in one line, or None when it can (or is built on demand).
    Asks the hub at most once, with a short timeout, and never for a local folder or a cached name."""
    if model is None or os.path.isdir(model):
        return None
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.path.exists(model):
        return f"--model {model}: no such folder (a local model is a folder with config.json and the tokenizer files)"
    from huggingface_hub import HfApi, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None  # in the local Hugging Face cache
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return f"--model {model}: not a local folder and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
    try:
        HfApi().model_info(model, timeout=10)
    except Exception as e:  # noqa: BLE001 -- any answer but a model's is the same refusal, said in one line
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = (f"the hub has no model of that name (HTTP {status})" if status in (401, 404)
               else f"the hub cannot be reached ({type(e).__name__}: {str(e)[:120]})")
        return f"--model {model}: not a local folder, not in the Hugging Face cache, and {why}"
    return None


def resolve(model: str | None, env: str, cache_dir: str) -> str:
    """The folder (or hub name) that `from_pretrained` loads for --model `model`."""
    if model is None:
        return default_model_path(env, cache_dir)
    return os.path.expanduser(model)
