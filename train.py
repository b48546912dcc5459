"""Multi-turn RL for LLM agents, top to bottom: rollout -> advantages -> update -> log/checkpoint.

    python train.py --env textcraft --schedule 10,20,30            # ScalingInter-RL, 3 horizon stages
    python train.py --env babyai --schedule 15 --algo ppo           # fixed horizon, PPO with a critic
    python train.py --env corridor --steps 40 --resume              # continue a run in --out
    torchrun --nproc-per-node 8 train.py --env textcraft --model Qwen/Qwen2.5-7B-Instruct --engine vllm

Each step: the scheduler gives the turn horizon K; `batch_size` training tasks x `group_size` copies
are played for up to K assistant turns (rollout.py); advantages come from algos.py (GRPO, RLOO,
REINFORCE++, or GAE with a critic for PPO); the policy takes `ppo_epochs` passes of clipped policy-
gradient updates over mini-batches, micro-batched by length. Without `--env-addr` a local env server
is started and stopped at exit. Logs: OUT/metrics.jsonl, OUT/rollouts/step_*.jsonl, OUT/config.json;
checkpoints in OUT/checkpoint (an HF model folder + optim.pt + trainer_state.pt), written atomically.
Ctrl-C or SIGTERM saves a checkpoint that --resume continues exactly (checkpoints.py); env failures
cost only the trajectories they touch (`env_ready`, and the README's "Reliability").

Under torchrun (one process per GPU, or per CPU slot with gloo) every rank plays batch_size / N whole
groups, the policy, reference model and critic are sharded with FSDP2, and the update equals the one a
single process would make on all ranks' trajectories; rank 0 writes logs and checkpoints. See the
"distributed" section and distributed.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

import algos
from checkpoints import Interrupts, find_checkpoint, load_checkpoint, save_checkpoint, truncate_logs
from distributed import (all_gather_list, all_max, all_sum, barrier, broadcast_value, gathered, global_rank,
                         global_whiten, init_distributed, rank_items, world_size)
from env_client import EnvError, EnvPool, task_splits
from agents import INSTRUCTIONS, SCHEMES, opens_by_guessing
from rollout import (ChatFormat, RolloutConfig, Trajectory, build_batch, length_buckets, make_engine, rollout,
                     write_log)
from scheduler import make_schedule


def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # Environment
    env: str = arg("textcraft", "environment: textcraft, babyai, corridor, ...")
    env_addr: str | None = arg(None, "URL of a running env server; absent: start one locally")
    tasks_file: str | None = arg(None, "JSON task ids: {\"train\": [...], \"test\": [...]} or a list (the training "
                                       "tasks); ids as ints, \"<env>_<n>\" or {\"item_id\": ...} (the original release)")
    # Horizon schedule (ScalingInter-RL)
    schedule: str = arg("10,20,30", "turn horizons: '15' fixed, '10,20,30' grows stage by stage")
    schedule_every: int | None = arg(None, "steps per stage (default: steps / number of stages)")
    schedule_kind: str = arg("step", "step: fixed stage length; plateau: advance when success stalls",
                             choices=["step", "plateau"])
    # Algorithm
    algo: str = arg("grpo", "advantage estimator", choices=["grpo", "rloo", "reinforce_pp", "ppo"])
    steps: int = arg(15, "training steps")
    batch_size: int = arg(8, "tasks per step (the paper: 16-32 on 8 GPUs)")
    group_size: int = arg(8, "trajectories per task (GRPO/RLOO groups)")
    lr: float | None = arg(None, "policy learning rate (AdamW); default: 1e-6 with --model (the paper's, for "
                                 "3B-7B models), 3e-4 for the built-in tiny model")
    critic_lr: float = arg(1e-4, "critic learning rate (PPO)")
    lr_decay: str = arg("none", "learning rates over the steps: none (constant), linear or cosine from --lr at step "
                                "1 down to --lr/steps at the last (lr_at)", choices=["none", "linear", "cosine"])
    weight_decay: float = arg(0.0, "AdamW weight decay")
    ppo_epochs: int = arg(1, "passes over each batch")
    mini_batch_size: int | None = arg(None, "trajectories per optimizer step (default: the whole batch)")
    micro_batch_tokens: int = arg(16384, "padded tokens per forward/backward pass")
    clip_low: float = arg(0.2, "PPO ratio clip below 1")
    clip_high: float = arg(0.2, "PPO ratio clip above 1")
    dual_clip: float | None = arg(None, "dual-clip constant (> 1) for negative advantages")
    value_clip: float = arg(0.2, "critic value clip (PPO)")
    kl_coef: float = arg(0.0, "KL-to-reference loss coefficient (0: no reference model)")
    kl_kind: str = arg("k3", "KL estimator", choices=["k1", "k2", "k3"])
    entropy_coef: float = arg(0.0, "entropy bonus coefficient")
    gamma: float = arg(1.0, "discount over sampled tokens (REINFORCE++, PPO)")
    lam: float = arg(1.0, "GAE lambda (PPO)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    loss_agg: str = arg("seq_mean_token_mean", "loss aggregation", choices=list(algos.AGG_MODES))
    tis_cap: float | None = arg(None, "truncated importance sampling: weight each token's policy loss by "
                                      "min(pi_old / pi_sampler, C), this C (absent: off)")
    grad_checkpointing: bool = arg(False, "recompute activations in the backward (less memory, ~30% slower)")
    # Agent (agents.py)
    agent: str = arg("react", "agent scheme: react (Thought/Action), plan (plan first, then act), reflect "
                              "(reflect and retry after a failed attempt)", choices=sorted(SCHEMES))
    # Generation
    model: str | None = arg(None, "HF model folder or hub name; absent: the built-in tiny model")
    engine: str = arg("hf", "generation engine: HF generate (anywhere) or vLLM (GPU; one engine per rank)",
                      choices=["hf", "vllm"])
    vllm_gpu_memory: float = arg(0.5, "vLLM: share of the GPU memory for weights and KV cache")
    temperature: float = arg(1.0, "sampling temperature")
    top_p: float = arg(1.0, "nucleus sampling")
    max_new_tokens: int = arg(64, "tokens per assistant turn")
    max_context: int = arg(4096, "tokens per trajectory")
    # Held-out evaluation (the env's test split, sampled at --temperature as in the paper)
    eval_every: int = arg(15, "evaluate on held-out test tasks every N steps, before the first and after the "
                              "last (0: never)")
    eval_tasks: int = arg(52, "test tasks per evaluation, spread over the split (0: all)")
    eval_batch: int = arg(64, "held-out episodes played at once: env instances, beside training's (SciWorld: JVMs)")
    eval_turns: int | None = arg(None, "horizon of the evaluation episodes (default: the schedule's largest)")
    # Run
    seed: int = arg(0, "seed of task order, sampling and init")
    out: str | None = arg(None, "run folder (default runs/{env}__{algo}__{seed}__{time})")
    resume: bool = arg(False, "continue the run in --out from its checkpoint")
    save_every: int = arg(0, "checkpoint every N steps (0: only at the end)")
    device: str = arg("auto", "cpu, cuda or auto")
    threads: int = arg(0, "CPU threads for torch per process (0: during rollouts all cores but one, which the env "
                          "server needs, during the update all; shared by the processes of this node)")
    cache_dir: str = arg(os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"),
                         "where the built-in tiny model is built once")
    # Faults (see "reliability" in the README)
    env_timeout: float = arg(120.0, "seconds to wait for an env server's answer; past it the trajectory is an "
                                    "env error")
    max_env_error_share: float = arg(0.5, "a step whose share of env-error trajectories is above this is not "
                                          "trained on")
    env_error_patience: int = arg(3, "stop, with a checkpoint, after this many such steps in a row")
    env_wait: float = arg(120.0, "after such a step, wait up to this many seconds for the env server to answer "
                                 "again (a local one that died is restarted)")


def config_parser(cls, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one `--dashed-flag` per field of the config dataclass `cls`, its default,
    type, choices and one-line help; bool fields become switches. train.py, sft.py and eval.py share it."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        p.add_argument(flag, type=kind, default=f.default, help=meta["help"], choices=meta.get("choices"))
    return p


def check_positive(p: argparse.ArgumentParser, cfg, names) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def check_served_elsewhere(p: argparse.ArgumentParser, cfg) -> None:
    """An env this project does not serve (WebArena) needs the address of its server, and a model: the
    built-in tiny model is made from the text of the envs served here."""
    from env_server import ENVS

    if cfg.env in ENVS:
        return
    if cfg.env not in INSTRUCTIONS:
        p.error(f"--env {cfg.env!r}: not one of {sorted(set(ENVS) | set(INSTRUCTIONS))}")
    if cfg.env_addr is None:
        p.error(f"--env {cfg.env} is served by another project: give its server's address with --env-addr")
    if getattr(cfg, "model", None) is None and getattr(cfg, "checkpoint", None) is None \
            and getattr(cfg, "endpoint", None) is None:
        p.error(f"--env {cfg.env} needs --model: the built-in tiny model only knows the envs served here")


def parse_args(argv=None) -> Config:
    p = config_parser(Config, __doc__)
    cfg = Config(**vars(p.parse_args(argv)))
    check_positive(p, cfg, ("steps", "batch_size", "group_size", "ppo_epochs", "max_new_tokens", "micro_batch_tokens",
                            "eval_batch"))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if cfg.batch_size % world:
        p.error(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({world}): each "
                "rank plays whole groups")
    if cfg.mini_batch_size is not None and cfg.mini_batch_size % world:
        p.error(f"--mini-batch-size {cfg.mini_batch_size} must be divisible by the number of processes ({world})")
    if cfg.tis_cap is not None and cfg.tis_cap <= 0:
        p.error("--tis-cap must be positive")
    if not 0 < cfg.vllm_gpu_memory <= 1:
        p.error("--vllm-gpu-memory must be in (0, 1]")
    if cfg.mini_batch_size is not None and not 1 <= cfg.mini_batch_size:
        p.error("--mini-batch-size must be at least 1")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1:
        p.error("--dual-clip must be greater than 1")
    if cfg.max_context <= cfg.max_new_tokens:
        p.error("--max-context must be larger than --max-new-tokens")
    if cfg.resume and not cfg.out:
        p.error("--resume needs --out: the run folder to continue")
    check_served_elsewhere(p, cfg)
    if cfg.lr is None:
        cfg.lr = 1e-6 if cfg.model else 3e-4
    for name in ("eval_every", "eval_tasks"):
        if getattr(cfg, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more")
    if cfg.eval_turns is not None and cfg.eval_turns < 1:
        p.error("--eval-turns must be at least 1")
    if not cfg.env_timeout > 0:
        p.error("--env-timeout must be a positive number of seconds")
    if not 0 <= cfg.max_env_error_share < 1:
        p.error("--max-env-error-share must be in [0, 1)")
    if cfg.env_error_patience < 1:
        p.error("--env-error-patience must be at least 1")
    if cfg.env_wait < 0:
        p.error("--env-wait must be 0 or more")
    try:
        make_schedule(cfg.schedule, cfg.schedule_every or 1, cfg.schedule_kind)
    except ValueError as e:
        p.error(str(e))
    return cfg


# ---------------------------------------------------------------- models
# The built-in tiny models, per env: (tokenizer kind, layers, hidden size). Corridor's policy starts from
# random weights with a word-level vocabulary (its learning test); the others are warm-started (sft.py).
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
    """The policy train.py and eval.py use without --model: the tiny model after the env's warm start
    (sft.WARM_START: behavioural cloning on a deliberately noisy expert, then, with `guess`, a guessing
    or stalling habit), built once and cached, stage by stage; the random tiny model for envs without a
    recipe."""
    import sft

    base = tiny_model_path(env, cache_dir)
    recipe = sft.WARM_START.get(env)
    if recipe is None:
        return base
    tag = "-".join(f"{k}{v}" for k, v in sorted(recipe.items()) if k not in sft.GUESS_KEYS)
    path = f"{base}-warm-{tag}"
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"building the warm-started tiny model for {env} (once; cached in {path})", flush=True)
        steps = recipe.get("copy_steps", 0)
        if steps:  # stage 1 has its own folder: a change to the rest of the recipe reuses it
            base = build_once(f"{base}-copy{steps}", lambda tmp: sft.copy_stage(env, base, tmp, steps))
    path = build_once(path, lambda tmp: sft.warm_start(env, base, tmp))
    if "guess" not in recipe:
        return path
    keys = [f"{k}{recipe[k]}".replace(" ", "_") for k in sft.GUESS_KEYS if k in recipe]
    guess_path = path + "-guess-" + "-".join(keys)
    if not os.path.exists(os.path.join(guess_path, "config.json")):
        print(f"building stage 3 of the {env} warm start, its habit (once; cached in {guess_path})", flush=True)
    return build_once(guess_path, lambda tmp: sft.guess_stage(env, path, tmp))


class Critic(torch.nn.Module):
    """A value head on a copy of the policy's transformer body: V(prefix) for every position."""

    def __init__(self, path: str):
        super().__init__()
        from transformers import AutoModel

        self.body = AutoModel.from_pretrained(path)
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        v = self.head(h.to(self.head.weight.dtype))  # (B, T, 1); a bf16 body may feed an fp32 head
        return v.squeeze(-1).float().clone()  # (B, T); not a view, which FSDP warns about as a module's output


def token_logprobs(model, mb: dict, temperature: float, with_entropy: bool = False, mask=None):
    """Log-probs (and entropies) of tokens 1..T-1 given their prefixes: (b, T-1), the trainer's side of
    the sampler's tempered log-probs.

    With `mask` (b, T-1), only positions where it is 1 are computed (0 elsewhere): the LM head, the
    largest tensor of a small model's step (b x T x vocab), runs on those hidden states alone. That
    needs logits == output_embeddings(last hidden state), true of Llama, Qwen, Mistral and Phi; it is
    checked once per model class against the full forward, which is used where it does not hold."""
    ids = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")}
    if mask is None or not _head_split_ok(model):
        logits = model(**ids).logits[:, :-1].float()
        sel = None
    else:
        sel = mask > 0
        logits = _masked_logits_of(model)(sel=sel, **ids).float()  # (n, V): the masked positions only
    if temperature > 0:
        logits = logits / temperature
    targets = mb["input_ids"][:, 1:]
    lp = algos.logprobs_from_logits(logits, targets if sel is None else targets[sel])
    ent = algos.entropy_from_logits(logits) if with_entropy else None
    if sel is not None:  # scatter back to (b, T-1)
        lp = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
        if ent is not None:
            ent = torch.zeros(sel.shape, dtype=ent.dtype, device=ent.device).masked_scatter(sel, ent)
    return lp, ent


def masked_logits(model, sel=None, **ids) -> torch.Tensor:
    """The LM head on the last hidden states of positions 0..T-2 where `sel` (b, T-1) is True: (n, V);
    on all of them without `sel`: (b, T-1, V). Under FSDP it is bound to the model and registered as a
    forward method (shard_model), so that the root's weights (embeddings, LM head) are gathered for it
    as they are for forward()."""
    h = model.base_model(**ids).last_hidden_state[:, :-1]
    return model.get_output_embeddings()(h if sel is None else h[sel])


def _masked_logits_of(model):
    return getattr(model, "masked_logits", None) or (lambda **kw: masked_logits(model, **kw))


_HEAD_SPLIT: dict = {}


def _head_split_ok(model) -> bool:
    """Whether model(x).logits == output_embeddings(base_model(x).last_hidden_state), on a short input."""
    key = type(model)
    if key not in _HEAD_SPLIT:
        try:
            with torch.no_grad():
                x = torch.arange(1, 9, device=model.device)[None] % model.config.vocab_size
                full = model(input_ids=x).logits[:, :-1]
                split = _masked_logits_of(model)(input_ids=x)
            _HEAD_SPLIT[key] = bool(torch.allclose(full.float(), split.float(), atol=1e-4, rtol=1e-3))
        except Exception:  # no base_model / output embeddings in the usual places
            _HEAD_SPLIT[key] = False
    return _HEAD_SPLIT[key]


def shifted(batch: dict) -> dict:
    """Per-token tensors moved to 'target' coordinates: position t holds token t+1's mask, log-prob,
    reward, as produced from the logits at t."""
    return {"mask": batch["loss_mask"][:, 1:], "old_logprobs": batch["old_logprobs"][:, 1:]}


def micro_weight(mask_micro: torch.Tensor, denominator: float, mode: str, world: int = 1) -> float:
    """The factor on a micro-batch's loss (aggregated over the micro-batch alone) before backward, so
    that the gradients accumulated over micro-batches and ranks are those of the mini-batch's loss
    aggregated over all of it, in every mode:
        w = world * agg_denominator(micro) / denominator,
    `denominator` being agg_denominator of the whole mini-batch on all ranks together (tokens for
    token_mean, rows with a sampled token for the sequence means). The factor `world` undoes FSDP's
    averaging of gradients over ranks: sum_ranks sum_micro w/world * loss_micro = the global loss."""
    return world * algos.agg_denominator(mask_micro, mode) / max(denominator, 1.0)


# ---------------------------------------------------------------- distributed (torchrun)
# The torchrun plumbing (process group, collectives, rank slicing) lives in distributed.py; here is
# what depends on the models and the engine: FSDP2 sharding and generation under it.
def shard_model(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2, in place: each decoder layer is a unit whose weights are all-gathered just before it runs
    and freed after it (and again in the backward), then the root (embeddings, final norm, LM head or
    value head), which keeps its weights from the forward to the backward. On CUDA the units compute in
    bf16 from fp32 master shards and reduce gradients in fp32; on CPU everything is fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda"
          else MixedPrecisionPolicy())
    layer_classes = set().union(*(getattr(m, "_no_split_modules", None) or () for m in module.modules()))
    for m in [m for m in module.modules() if type(m).__name__ in layer_classes and m is not module]:
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    if hasattr(module, "get_output_embeddings") and module.get_output_embeddings() is not None:
        module.masked_logits = types.MethodType(masked_logits, module)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if hasattr(module, "masked_logits"):
        register_fsdp_forward_method(module, "masked_logits")
    return module


@contextlib.contextmanager
def generating(engine, model, cfg: Config):
    """The engine ready to sample: vLLM woken up (weights and KV cache back on the GPU) and put back to
    sleep after, leaving the memory to the update; HF generate with the policy's weights gathered."""
    if hasattr(engine, "wake_up"):
        engine.wake_up()
    try:
        with gathered(model) if cfg.engine == "hf" else contextlib.nullcontext():
            yield
    finally:
        if hasattr(engine, "sleep"):
            engine.sleep()


# ---------------------------------------------------------------- the loop
def main(cfg: Config) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # -------- setup
    rank, world, device = init_distributed(cfg.device)
    try:
        if cfg.out is None:  # rank 0's clock names the run
            cfg.out = broadcast_value(os.path.join(
                "runs", f"{cfg.env}__{cfg.algo}__{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"))
        ckpt = find_checkpoint(cfg.out) if cfg.resume else None
        if cfg.resume and ckpt is None:
            sys.exit(f"--resume: no checkpoint in {cfg.out}")
        if rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            with open(os.path.join(cfg.out, "config.json"), "w") as f:
                json.dump(dataclasses.asdict(cfg), f, indent=2)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        # An oversubscribed CPU is catastrophic for torch's OpenMP threads (100x slower when the env server
        # takes a core they spin on), so leave one core free by default, shared by this node's processes.
        # (The update makes no env call: there train() gives torch every core.)
        threads = cfg.threads or max(1, ((os.cpu_count() or 2) - 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if cfg.model is None and not cfg.resume:  # build the warm start (once) while no env server runs
            if rank == 0:
                torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
                default_model_path(cfg.env, cfg.cache_dir)
            barrier()
        torch.set_num_threads(threads)

        server = None
        if cfg.env_addr is None:  # one per rank (see "distributed")
            from env_server.app import ServerProcess
            server = ServerProcess(cfg.env)
        url = cfg.env_addr or server.url
        try:
            return train(cfg, url, ckpt, device, AutoModelForCausalLM, AutoTokenizer, server)
        finally:
            if server is not None:
                server.stop()
    finally:
        if world > 1:
            dist.destroy_process_group()


def train(cfg: Config, url: str, ckpt: str | None, device, AutoModelForCausalLM, AutoTokenizer, server=None) -> dict:
    rank, world = global_rank(), world_size()
    threads = torch.get_num_threads()  # while env servers work; the update, which makes no env call, has all
    update_threads = cfg.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        tasks = task_splits(url, cfg.env, cfg.tasks_file)
    except ValueError as e:
        sys.exit(str(e))
    train_ids = tasks["splits"].get("train")
    if not train_ids:
        sys.exit(f"no training tasks at {url}" + (f" in --tasks-file {cfg.tasks_file}" if cfg.tasks_file else ""))
    init_path = cfg.model or default_model_path(cfg.env, cfg.cache_dir)  # initial policy, KL reference
    model_path = os.path.join(ckpt, "model") if ckpt else init_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    fmt = ChatFormat(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.eot_id

    def place(m: torch.nn.Module, trained: bool) -> torch.nn.Module:
        """On the device. Under torchrun: fp32 master weights, sharded at once (shard_model), so that no
        more than one full copy of a model is ever on a GPU; the reference model and the critic are as
        large as the policy and are sharded too. One process keeps the checkpoint's dtype."""
        if trained and cfg.grad_checkpointing:  # recompute each layer's activations in the backward
            (m.body if isinstance(m, Critic) else m).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        m = m.to(device=device, dtype=torch.float32 if world > 1 else None)
        return shard_model(m, device) if world > 1 else m

    model = place(AutoModelForCausalLM.from_pretrained(model_path).train(), trained=True)
    ref = place(AutoModelForCausalLM.from_pretrained(init_path).eval(), trained=False) if cfg.kl_coef > 0 else None
    critic = place(Critic(model_path), trained=True) if cfg.algo == "ppo" else None
    optims = {"policy": torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)}
    if critic is not None:
        optims["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
    n_stages = len(cfg.schedule.split(","))
    every = cfg.schedule_every or max(1, -(-cfg.steps // n_stages))
    schedule = make_schedule(cfg.schedule, every, cfg.schedule_kind)
    # vLLM: a whole-model engine per rank, each sampling its own rank's prompts; under torchrun vLLM's
    # external launcher counts the ranks as data-parallel engines (world = tp x pp x dp, here dp = N).
    vllm_kwargs = ({"gpu_memory_utilization": cfg.vllm_gpu_memory, "max_model_len": cfg.max_context}
                   if cfg.engine == "vllm" else {})
    if cfg.engine == "vllm" and world_size() > 1:
        vllm_kwargs["data_parallel_size"] = world_size()
    engine = make_engine(cfg.engine, model, model_path, pad_id, **vllm_kwargs)  # under torchrun: one per rank
    data_rng = random.Random(cfg.seed)  # the same on every rank: all ranks draw the same tasks
    sample_gen = torch.Generator(gen_device(cfg, device)).manual_seed(cfg.seed + rank)
    start = 1
    if ckpt:
        st = load_checkpoint(ckpt, model, critic, optims)
        schedule.load_state_dict(st["schedule"])
        data_rng.setstate(st["data_rng"])
        rngs = st["rank_rngs"]
        if len(rngs) == world and st["device_type"] == sample_gen.device.type:
            sample_gen.set_state(rngs[rank]["sample_gen"])
            torch.set_rng_state(rngs[rank]["torch_rng"])
        else:  # another number of ranks: same data order, new sampling streams
            if rank == 0:
                print(f"resuming {len(rngs)} {st['device_type']} rank(s) as {world} {sample_gen.device.type} rank(s): "
                      "the tasks continue in order, sampling from new seeds", flush=True)
            sample_gen.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
            torch.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
        start = st["step"] + 1
        if rank == 0:
            truncate_logs(cfg.out, st["step"])
    test_ids = spread(tasks["splits"].get("test", []), cfg.eval_tasks)
    categories = tasks["categories"]
    eval_K = cfg.eval_turns or max(int(k) for k in cfg.schedule.split(","))
    evals: list[dict] = []
    if ckpt and os.path.exists(os.path.join(cfg.out, "eval.jsonl")):  # a resumed run: earlier evaluations
        with open(os.path.join(cfg.out, "eval.jsonl")) as f:
            evals = [json.loads(x) for x in f if x.strip()]

    def held_out(step: int) -> None:  # every rank plays its share of the test tasks; rank 0 writes
        if cfg.eval_every and test_ids:
            with generating(engine, model, cfg):
                r = evaluate_held_out(cfg, engine, fmt, url, test_ids, eval_K, step, categories, device)
            evals.append(r)
            if rank == 0:
                with open(os.path.join(cfg.out, "eval.jsonl"), "a") as f:
                    f.write(json.dumps(r) + "\n")
                tqdm.write(f"held-out eval after step {step}: success {r['success_rate']:.3f} on {r['tasks']} "
                           f"test tasks (K={eval_K}, {r['time_s']:.0f}s)")

    def snapshot() -> dict:
        """What a run resumed after the last update needs besides weights and optimizer: the schedule
        and this rank's random streams (data order, sampling, torch)."""
        return {"schedule": schedule.state_dict(), "data_rng": data_rng.getstate(),
                "rng": {"sample_gen": sample_gen.get_state(), "torch_rng": torch.get_rng_state()}}

    def save(step: int, snap: dict) -> None:
        state = {"step": step, "schedule": snap["schedule"], "data_rng": snap["data_rng"],
                 "rank_rngs": all_gather_list([snap["rng"]]), "device_type": sample_gen.device.type,
                 "config": dataclasses.asdict(cfg)}
        save_checkpoint(cfg.out, model, tokenizer, critic, optims, state)

    def eval_due(step: int) -> bool:
        return step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)

    t_start = time.time()
    pool = EnvPool(url, cfg.batch_size // world * cfg.group_size, timeout=cfg.env_timeout)
    rcfg = RolloutConfig(max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context,
                         temperature=cfg.temperature, top_p=cfg.top_p)
    summary: dict = {}
    safe = (start - 1, snapshot())  # (step, states): what a stop saves, with the weights as they are
    saved = start - 1  # the step of the checkpoint on disk (0: none)
    bad_steps = 0  # steps in a row with too many env errors
    bar = tqdm(range(start, cfg.steps + 1), desc=f"{cfg.env} {cfg.algo}", initial=start - 1, total=cfg.steps,
               dynamic_ncols=True, disable=rank != 0)
    try:
        with Interrupts(defer_all=world > 1) as intr:
            try:
                if start == 1 or (eval_due(start - 1) and all(e["step"] != start - 1 for e in evals)):
                    held_out(start - 1)  # the starting policy (or an evaluation a stop cut short)
                for step in bar:
                    safe = (step - 1, snapshot())  # a stop in this step's rollout replays the step on resume
                    env_ready(server, url, cfg.env_wait if bad_steps else 0.0)
                    # -------- rollout: this rank's whole groups; then every rank's trajectories, in rank order
                    K = schedule.max_turns(step)
                    rcfg.max_turns = K
                    chosen = data_rng.sample(train_ids, min(cfg.batch_size, len(train_ids)))
                    item_ids, groups = rank_items(chosen, cfg.batch_size, cfg.group_size, rank, world)
                    t0 = time.time()
                    with generating(engine, model, cfg):
                        trajs = rollout(engine, fmt, pool, cfg.env, item_ids, groups, rcfg, sample_gen,
                                        agent=cfg.agent)
                    everyone = all_gather_list(trajs)
                    time_rollout = time.time() - t0
                    if rank == 0:
                        write_log(os.path.join(cfg.out, "rollouts", f"step_{step:06d}.jsonl"), step, K, everyone)
                    kept = [t for t in trajs if t.status != "env_error"]  # infrastructure failures are not rewards
                    kept_all = [t for t in everyone if t.status != "env_error"]
                    m = rollout_metrics(everyone, kept_all, K, time_rollout)
                    # Too many env errors: what is left is a biased sample (say, only the short episodes).
                    bad = len(everyone) - len(kept_all) > cfg.max_env_error_share * len(everyone)
                    bad_steps = bad_steps + 1 if bad else 0
                    if not bad:  # a plateau schedule watches success; a biased sample would mislead it
                        schedule.observe(step, m["success_rate"])

                    with intr.critical():  # a signal here waits: never save half an update
                        # -------- advantages and update (collective: every rank, even one without a trajectory)
                        t1 = time.time()
                        if kept_all and not bad:
                            m["lr"] = set_lr(optims, cfg, step)
                            torch.set_num_threads(update_threads)
                            try:
                                m.update(update(cfg, model, critic, ref, optims, kept, pad_id, device))
                            finally:
                                torch.set_num_threads(threads)
                        m["time_update_s"] = time.time() - t1
                        m["skipped_update"] = int(bad or not kept_all)
                        # -------- new weights to the generation engine (HF: the same module, nothing to copy)
                        sync_s = engine.sync_weights(model)
                        m["time_sync_s"] = float(sync_s or 0.0)
                        m["step"] = step
                        if rank == 0:
                            with open(os.path.join(cfg.out, "metrics.jsonl"), "a") as f:
                                f.write(json.dumps(m) + "\n")
                        safe = (step, snapshot())
                    bar.set_postfix(K=K, reward=f"{m['reward_mean']:.2f}", success=f"{m['success_rate']:.2f}")
                    summary = m
                    if bad:
                        errors = [t.error for t in everyone if t.status == "env_error"]
                        tqdm.write(f"step {step}: {len(errors)}/{len(everyone)} trajectories hit env errors, "
                                   f"above --max-env-error-share {cfg.max_env_error_share:g}: not trained on. "
                                   f"First: {errors[0]}")
                        if bad_steps >= cfg.env_error_patience:
                            with intr.critical():
                                save(*safe)
                            sys.exit(f"stopping: {bad_steps} steps in a row had more than "
                                     f"{cfg.max_env_error_share:.0%} env-error trajectories (--max-env-error-share, "
                                     f"--env-error-patience). Last error: {errors[0]}\n"
                                     f"The checkpoint at step {step} is in {cfg.out}; fix the env server and "
                                     "continue with --resume.")

                    if eval_due(step):
                        held_out(step)
                    # -------- checkpoint
                    if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                        with intr.critical():
                            save(*safe)
                            saved = step
                    if world > 1 and all_max(int(intr.signum is not None)):  # the ranks stop together
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                done, snap = safe
                if done > saved:
                    save(done, snap)
                    saved = done
                if rank == 0:
                    tqdm.write(f"interrupted ({signal.Signals(intr.signum or signal.SIGINT).name}): " +
                               (f"checkpoint at step {saved} in {cfg.out}; continue with --resume --out {cfg.out}"
                                if saved else "stopped before the first step ended; nothing to save"))
                sys.exit(128 + (intr.signum or signal.SIGINT))
    finally:
        bar.close()
        pool.close()
    if rank != 0:
        return summary
    return {**summary, **print_summary(cfg, evals, time.time() - t_start)}


def env_ready(server, url: str, wait_s: float) -> None:
    """Before a step: restart the local env server if it died; after a failed step, also wait up to
    `wait_s` for the server to answer (a restart elsewhere takes a while). The pool replaces the lost
    instances at its next reset."""
    from env_client import Transport

    deadline = time.time() + wait_s
    while True:
        if server is not None and not server.alive():
            tqdm.write(f"the env server died (exit code {server.proc.returncode}); restarting it on {server.url}")
            try:
                server.restart()
            except RuntimeError as e:
                tqdm.write(f"could not restart the env server: {e}")
        if wait_s <= 0:
            return
        try:
            Transport(url, timeout=5.0, retries=0).request("GET", "/")
            return
        except EnvError as e:
            if e.kind not in ("connection", "timeout"):
                return  # it answered (AgentGym's servers answer their health check in plain text)
            if time.time() > deadline:
                tqdm.write(f"the env server at {url} has not answered for {wait_s:g} s: {e}")
                return
        time.sleep(1.0)


def gen_device(cfg: Config, device) -> torch.device:
    """Where the sampling generator lives: HF generate draws tokens on the model's device (a CPU
    generator cannot drive CUDA sampling); VLLMEngine draws its per-request seeds on the CPU."""
    return torch.device(device) if cfg.engine == "hf" else torch.device("cpu")


def spread(ids: list[int], k: int) -> list[int]:
    """k ids spread evenly over the list (all of them when k is 0 or too large)."""
    if not k or k >= len(ids):
        return list(ids)
    return [ids[i * len(ids) // k] for i in range(k)]


def evaluate_held_out(cfg: Config, engine, fmt, url: str, test_ids: list[int], K: int, step: int,
                      categories: dict | None = None, device="cpu") -> dict:
    """One sampled episode per held-out test task at horizon K, at the training temperature (the paper
    evaluates at 1), with a fixed seed so every evaluation draws the same random numbers. Success = done
    with reward > 0; env errors are left out and counted. Under torchrun rank r plays every N-th task
    from the r-th, and every rank returns the result over all of them."""
    from eval import categories_for, play_in_chunks

    t0 = time.time()
    rank, world = global_rank(), world_size()
    rcfg = RolloutConfig(max_turns=K, max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context,
                         temperature=cfg.temperature, top_p=cfg.top_p)
    gen = torch.Generator(gen_device(cfg, device)).manual_seed(cfg.seed + 12345 + rank)
    mine = test_ids[rank::world]
    try:
        trajs = play_in_chunks(url, cfg.eval_batch, mine, list(range(len(mine))),
                               lambda pool, items, groups: rollout(engine, fmt, pool, cfg.env, items, groups, rcfg, gen,
                                                                   agent=cfg.agent),
                               desc=f"held-out eval @ step {step}", leave=False, timeout=cfg.env_timeout) if mine else []
    except EnvError as e:  # no env server to play on: this evaluation has no result; training goes on
        tqdm.write(f"held-out evaluation at step {step} failed: {e}")
        trajs = [Trajectory(cfg.env, i, -1, [], [], [], [], status="env_error") for i in mine]
    episodes = all_gather_list([(t.item_id, t.status, t.reward, t.turns, opens_by_guessing(t.messages))
                                for t in trajs])
    kept = [e for e in episodes if e[1] != "env_error"]
    cat = categories_for(cfg.env, test_ids, categories)
    by_cat: dict[str, list[float]] = {}
    for item, status, reward, *_ in kept:
        by_cat.setdefault(cat[item], []).append(float(status == "done" and reward > 0))
    n = max(1, len(kept))
    return {"step": step, "max_turns": K, "tasks": len(kept), "env_errors": len(episodes) - len(kept),
            "success_rate": sum(status == "done" and reward > 0 for _, status, reward, *_ in kept) / n,
            "reward_mean": sum(e[2] for e in kept) / n, "turns_mean": sum(e[3] for e in kept) / n,
            "guess_share": sum(e[4] for e in kept) / n, "by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())}, "time_s": time.time() - t0}


def print_summary(cfg: Config, evals: list[dict], seconds: float) -> dict:
    """The end-of-run report: training success early and late, held-out success first and last."""
    evals = [e for e in evals if e["tasks"]]  # an evaluation the env server failed has no result
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    k = max(1, min(5, len(rows) // 2))
    mean = lambda rs, key: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    out = {"steps": len(rows), "minutes": seconds / 60, "out": cfg.out,
           "train_success_first": mean(rows[:k], "success_rate"), "train_success_last": mean(rows[-k:], "success_rate")}
    lines = [f"run {cfg.out}: {len(rows)} steps in {seconds / 60:.1f} min",
             f"  training success (mean of {k} steps): first {out['train_success_first']:.3f} -> last "
             f"{out['train_success_last']:.3f}"]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        out.update(eval_success_start=a["success_rate"], eval_success_end=b["success_rate"],
                   eval_step_start=a["step"], eval_step_end=b["step"])
        lines.append(f"  held-out success ({b['tasks']} test tasks, K={b['max_turns']}): step {a['step']} "
                     f"{a['success_rate']:.3f} -> step {b['step']} {b['success_rate']:.3f} "
                     f"({100 * (b['success_rate'] - a['success_rate']):+.1f} points)")
        if a.get("guess_share") or b.get("guess_share"):  # the built-in warm start's habit (sft.WARM_START)
            lines.append(f"  episodes opening with the warm start's habit (a guess or a stall): "
                         f"{a.get('guess_share', 0):.3f} -> {b.get('guess_share', 0):.3f}")
        width = max(map(len, b["by_category"]), default=0) + 2
        for c in b["by_category"]:
            lines.append(f"    {c:<{width}}{a['by_category'].get(c, float('nan')):.3f} -> {b['by_category'][c]:.3f}")
    lines.append(f"  curves: python plot.py {cfg.out}")
    print("\n".join(lines), flush=True)
    return out


def rollout_metrics(trajs, kept, K: int, time_rollout: float) -> dict:
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    statuses = {s: sum(t.status == s for t in trajs) for s in ("done", "max_turns", "context_limit", "env_error")}
    n = max(1, len(kept))
    return {"max_turns": K, "reward_mean": sum(t.reward for t in kept) / n,
            "success_rate": sum(t.status == "done" and t.reward > 0 for t in kept) / n,
            "turns_mean": sum(t.turns for t in kept) / n, **{f"status_{k}": v for k, v in statuses.items()},
            "guess_share": sum(opens_by_guessing(t.messages) for t in kept) / n,
            "template_mismatch": sum(t.template == "mismatch" for t in trajs),
            "tokens_per_s": gen_tokens / max(time_rollout, 1e-9), "time_rollout_s": time_rollout}


def lr_at(step: int, steps: int, decay: str) -> float:
    """The share of the base learning rate at `step` (1-based) of `steps`: 1 at step 1, and with decay,
    linear or along a half cosine, down to 1/steps at the last step (never 0: the last update counts)."""
    low = 1.0 / steps
    if decay == "linear":
        return 1.0 - (step - 1) / steps
    if decay == "cosine":
        t = (step - 1) / (steps - 1) if steps > 1 else 0.0
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * t))
    return 1.0


def set_lr(optims: dict, cfg: Config, step: int) -> float:
    """Put this step's learning rates (lr_at) into the optimizers; returns the policy's."""
    share = lr_at(step, cfg.steps, cfg.lr_decay)
    for name, o in optims.items():
        for g in o.param_groups:
            g["lr"] = share * (cfg.lr if name == "policy" else cfg.critic_lr)
    return share * cfg.lr


def update(cfg: Config, model, critic, ref, optims: dict, trajs, pad_id: int, device) -> dict:
    """Advantages, then `ppo_epochs` passes of clipped policy-gradient steps over mini-batches,
    micro-batched by length. Under torchrun each rank brings its own trajectories (whole groups) and the
    update is the one a single process would make on all of them: whitening uses every rank's tokens,
    and each micro-batch's loss is weighted by its share of the global loss (micro_weight). FSDP's
    forward and backward are collectives, so every rank runs as many passes as the busiest one, the
    extra ones on a blank row without sampled tokens (weight 0); a rank may bring no trajectory at all."""
    world = world_size()
    blank = [Trajectory("", -1, -1, [], [pad_id, pad_id], [0, 0], [0.0, 0.0])] if world > 1 else []
    batch = {k: v.to(device) for k, v in build_batch(list(trajs) + blank, pad_id).items()}
    sh = shifted(batch)
    mask = sh["mask"]  # (B, T-1); under torchrun row B is the blank one
    B = len(trajs)
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows = lambda idx: {k: batch[k][idx] for k in ("input_ids", "attention_mask", "position_ids")}  # noqa: E731

    def in_step(buckets: list[list[int]]) -> list[list[int]]:  # as many passes as the busiest rank
        return buckets + [[B]] * (all_max(len(buckets)) - len(buckets))

    def no_grad_pass(fn) -> torch.Tensor:  # fn(row indices) -> (b, T-1), for every row, by length buckets
        out = torch.zeros_like(mask)
        with torch.no_grad():
            for idx in in_step(length_buckets(lengths[:B], cfg.micro_batch_tokens)):
                out[idx] = fn(idx)
        return out

    # -------- advantages (B, T-1), on sampled tokens only
    token_rewards = algos.token_rewards_from_outcome(batch["rewards"], mask)
    values = None
    if cfg.algo == "grpo":  # groups are whole on each rank: nothing to share
        adv = algos.grpo_advantages(batch["rewards"], batch["group_ids"])[:, None] * mask
    elif cfg.algo == "rloo":
        adv = algos.rloo_advantages(batch["rewards"], batch["group_ids"])[:, None] * mask
    elif cfg.algo == "reinforce_pp":
        adv = global_whiten(algos.reinforce_pp_advantages(token_rewards, mask, cfg.gamma, whiten=False), mask)
    else:
        values = no_grad_pass(lambda idx: critic(**rows(idx))[:, :-1])  # V of the prefix that produced token t+1
        adv, returns = algos.gae_advantages(token_rewards, values, mask, cfg.gamma, cfg.lam, whiten=False)
        adv = global_whiten(adv, mask)
    ref_lp = None
    if ref is not None:
        ref_lp = no_grad_pass(lambda idx: token_logprobs(ref, rows(idx), cfg.temperature, mask=mask[idx])[0])

    # -------- the PPO ratio's denominator: the sampler's log-probs when the sampler is this very model
    # (HF generate), else (vLLM, or with --tis-cap) the trainer's own, recomputed before the update;
    # truncated importance weights correct for the tokens having been drawn from the sampler.
    sampler_lp = sh["old_logprobs"]
    old_lp = sampler_lp
    if cfg.tis_cap is not None or cfg.engine != "hf":
        old_lp = no_grad_pass(lambda idx: token_logprobs(model, rows(idx), cfg.temperature, mask=mask[idx])[0])
    tis = algos.tis_weights(old_lp, sampler_lp, cfg.tis_cap) if cfg.tis_cap is not None else None

    # -------- clipped policy-gradient epochs over mini-batches, micro-batched by length
    # Sums over this rank, added over ranks at the end: losses weighted by their share of the global
    # loss (so their total is that loss), per-micro-batch statistics, sampler/trainer mismatch per token.
    acc = dict.fromkeys(("loss", "entropy", "kl", "value_loss", "clip_frac", "approx_kl", "micro_batches",
                         "logprob_diff", "logprob_kl", "mismatch_tokens", "padded", "real"), 0.0)
    grad_norms = []
    mbs = cfg.mini_batch_size // world if cfg.mini_batch_size else max(B, 1)  # trajectories per rank per step
    n_minis = all_max(-(-B // mbs))
    for epoch in range(cfg.ppo_epochs):
        perm = torch.randperm(B).tolist()
        for s in range(n_minis):
            mini = perm[s * mbs:(s + 1) * mbs]  # may be empty on a rank with fewer trajectories
            (denominator,) = all_sum([algos.agg_denominator(mask[mini], cfg.loss_agg)])  # over all ranks
            for o in optims.values():
                o.zero_grad(set_to_none=True)
            buckets = [[mini[i] for i in b] for b in length_buckets([lengths[i] for i in mini], cfg.micro_batch_tokens)]
            for idx in in_step(buckets):
                mb = rows(idx)
                T = int(batch["attention_mask"][idx].sum(-1).max())  # cut the batch's padding
                mb = {k: v[:, :T] for k, v in mb.items()}
                mb_mask = mask[idx, :T - 1]
                w = micro_weight(mb_mask, denominator, cfg.loss_agg, world)
                share = w / world  # of the global mini-batch loss
                lp, ent = token_logprobs(model, mb, cfg.temperature, with_entropy=True, mask=mb_mask)
                loss, pst = algos.policy_loss(lp, old_lp[idx, :T - 1], adv[idx, :T - 1], mb_mask, cfg.clip_low,
                                              cfg.clip_high, cfg.dual_clip, cfg.loss_agg,
                                              None if tis is None else tis[idx, :T - 1])
                entropy = algos.agg_loss(ent, mb_mask, cfg.loss_agg)
                loss = loss - cfg.entropy_coef * entropy
                kl = torch.zeros(())
                if ref_lp is not None:
                    kl = algos.agg_loss(algos.kl_penalty(lp, ref_lp[idx, :T - 1], cfg.kl_kind), mb_mask, cfg.loss_agg)
                    loss = loss + cfg.kl_coef * kl
                if critic is not None:
                    v = critic(**mb)[:, :-1]
                    vloss, _ = algos.value_loss(v, values[idx, :T - 1], returns[idx, :T - 1], mb_mask,
                                                cfg.value_clip, cfg.loss_agg)
                    (w * vloss).backward()
                    acc["value_loss"] += share * float(vloss.detach())
                (w * loss).backward()
                for k, val in (("loss", loss), ("entropy", entropy), ("kl", kl)):
                    acc[k] += share * float(val.detach())
                if idx == [B]:  # a blank pass: nothing to count
                    continue
                acc["padded"] += len(idx) * T
                acc["real"] += sum(lengths[i] for i in idx)
                acc["micro_batches"] += 1
                acc["clip_frac"] += pst["clip_frac"]
                acc["approx_kl"] += pst["approx_kl"]
                if epoch == 0 and s == 0:  # before any update: how far the trainer's log-probs are from the sampler's
                    sel, mb_sampler = mb_mask > 0, sampler_lp[idx, :T - 1]
                    acc["logprob_diff"] += float((lp.detach() - mb_sampler).abs()[sel].sum())
                    acc["logprob_kl"] += float(algos.kl_penalty(mb_sampler, lp.detach(), "k3", None)[sel].sum())
                    acc["mismatch_tokens"] += float(sel.sum())
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            grad_norms.append(float(gn))
            if critic is not None:
                torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
            for o in optims.values():
                o.step()
    tot = dict(zip(acc, all_sum(list(acc.values()))))
    n_steps = cfg.ppo_epochs * n_minis
    out = {k: tot[k] / n_steps for k in ("loss", "entropy", "kl") + (("value_loss",) if critic is not None else ())}
    out.update({k: tot[k] / max(tot["micro_batches"], 1) for k in ("clip_frac", "approx_kl")})
    # KL(sampler || trainer) on the sampled tokens: k3 of log(pi_trainer / pi_sampler), the sampler's samples
    out.update({k: tot[k] / max(tot["mismatch_tokens"], 1) for k in ("logprob_diff", "logprob_kl")})
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["padding_share"] = 1 - tot["real"] / max(tot["padded"], 1)
    out["train_tokens"] = int(tot["real"])
    return out




if __name__ == "__main__":
    summary = main(parse_args())
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
        print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in summary.items()}))
