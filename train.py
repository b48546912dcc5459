"""Multi-turn RL for LLM agents, top to bottom: config, setup, one step (rollout -> advantages ->
update -> weight sync), then the loop.

    python train.py --env textcraft --schedule 10,20,30            # ScalingInter-RL, 3 horizon stages
    python train.py --env babyai --schedule 15 --algo ppo           # fixed horizon, PPO with a critic
    python train.py --env corridor --steps 40 --out runs/c --resume # continue a run
    python train.py --config runs/c/config.json --out runs/d --seed 1   # replay a run's config, one change
    torchrun --nproc-per-node 8 train.py --env textcraft --model Qwen/Qwen2.5-7B-Instruct --engine vllm

Each step: the schedule gives the turn horizon K; `batch_size` tasks x `group_size` copies are played for
up to K turns (rollout.py); the update (update.py) turns outcomes into per-token advantages by the
estimator --algo (algos.ESTIMATORS) and makes `ppo_epochs` passes of clipped policy-gradient steps over
mini-batches; the engine gets the new weights. The run folder (--out) holds config.json, metrics.jsonl, eval.jsonl, rollouts/,
summary.json and checkpoint/ (README, "Flags and the run folder"). Ctrl-C or SIGTERM saves a checkpoint
that --resume continues exactly. Under torchrun each rank plays batch_size / N whole groups, the models
are sharded with FSDP2 and the update equals one process's on all ranks' trajectories (distributed.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: cli.cpu_threads says why
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import algos
from checkpoints import Interrupts, find_checkpoint, load_checkpoint, resume_command, save_checkpoint, truncate_logs
from cli import (check_device, check_env, check_model, check_positive, check_ranges, check_reporter, cpu_threads,
                 parse_config, task_lists)
from config import Config
from distributed import (all_gather_list, all_max, barrier, broadcast_value, global_rank, init_distributed, rank_items,
                         world_size)
from engines import HFEngine, generating, make_engine, resolve_engine, sampling_device
from env_client import EnvPool, env_ready, spread
from env_server.process import serving
from eval import held_out
from models import resolve
from policy import Critic, Precision, load_model, load_tokenizer, pad_id, prepare, resolve_dtype
from report import make_reporter
from rollout import (ChatFormat, EnginePolicy, RolloutConfig, Trajectory, informative_groups, rollout, rollout_metrics,
                     write_log)
from scheduler import lr_at, make_schedule
from update import update


# ================================================================ config (the flags: config.py)
RUN_FILES = ("metrics.jsonl", "checkpoint")  # an --out holding one holds a run; a config.json alone does not


def parse_args(argv=None) -> Config:
    """The config: the flags, over --config FILE or (with --resume) the run's own config.json; every check
    here, before anything is written, so that a corrected command can follow a refused one."""
    p, cfg = parse_config(Config, argv, __doc__, prog="train.py")
    check_positive(p, cfg, ("steps", "batch_size", "group_size", "ppo_epochs", "max_new_tokens", "micro_batch_tokens",
                            "eval_batch", "eval_samples"))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    for name, value in (("batch-size", cfg.batch_size), ("mini-batch-size", cfg.mini_batch_size)):
        if value is not None and value % world:
            p.error(f"--{name} {value} must be divisible by the number of processes ({world}): each rank plays "
                    "whole groups")
    check_ranges(p, cfg, {
        "lr": "(0, inf)", "critic_lr": "(0, inf)", "temperature": "(0, inf)", "top_p": "(0, 1]", "gamma": "[0, 1]",
        "lam": "[0, 1]", "weight_decay": "[0, inf)", "clip_low": "[0, 1)", "clip_high": "[0, inf)",
        "tis_cap": "(0, inf)", "kl_coef": "[0, inf)", "value_clip": "(0, inf)", "max_grad_norm": "(0, inf)",
        "vllm_gpu_memory": "(0, 1]", "vllm_kv_tokens": "[0, inf)", "mini_batch_size": "[1, inf)", "dual_clip": "(1, inf)", "eval_every": "[0, inf)",
        "eval_tasks": "[0, inf)", "eval_turns": "[1, inf)", "schedule_every": "[1, inf)", "env_timeout": "(0, inf)",
        "env_wait": "[0, inf)", "max_env_error_share": "[0, 1)", "env_error_patience": "[1, inf)"})
    checks = [(cfg.max_context > cfg.max_new_tokens, "--max-context must be larger than --max-new-tokens"),
              (not cfg.resume or cfg.out, "--resume needs --out: the run folder to continue"),
              (not cfg.resume or not cfg.out or find_checkpoint(cfg.out), f"--resume: no checkpoint in {cfg.out}"),
              (cfg.save_every >= -1, "--save-every must be -1 (never), 0 (at the end) or a number of steps"),
              (cfg.warmup_steps is None or cfg.warmup_steps >= 0, "--warmup-steps must be 0 or more"),
              (cfg.max_update_kl is None or cfg.max_update_kl >= 0, "--max-update-kl must be 0 (off) or more"),
              (cfg.max_resample >= 0, "--max-resample must be 0 or more"),
              (not (cfg.dynamic_sampling and world > 1), "--dynamic-sampling runs in one process only (not under "
                                                         "torchrun)")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    check_device(p, cfg.device)
    check_env(p, cfg)
    check_model(p, cfg.model)
    check_reporter(p, cfg.report_to)
    try:
        schedule = make_schedule(cfg.schedule, stage_steps(cfg), cfg.schedule_kind)
    except ValueError as e:
        p.error(str(e))
    stages = len(cfg.schedule.split(","))
    if cfg.schedule_kind == "step" and schedule.stage(cfg.steps) < stages - 1:
        print(f"train.py: warning: --steps {cfg.steps} reaches {schedule.stage(cfg.steps) + 1} of the {stages} "
              f"stages of --schedule {cfg.schedule}; the later horizons are never played", file=sys.stderr)
    if cfg.out and not cfg.resume and any(os.path.exists(os.path.join(cfg.out, f)) for f in RUN_FILES):
        p.error(f"--out {cfg.out} already holds a run: give another folder, or --resume to continue that one")
    real = cfg.model is not None  # a real model: the trust-region defaults (docs/real_model.md)
    if cfg.lr is None:
        cfg.lr = 1e-6 if real else 3e-4
    if cfg.kl_coef is None:
        cfg.kl_coef = 0.001 if real else 0.0
    if cfg.warmup_steps is None:
        cfg.warmup_steps = 3 if real else 0
    if cfg.max_update_kl is None:
        cfg.max_update_kl = 0.01 if real else 0.0
    if cfg.dynamic_sampling is None:
        cfg.dynamic_sampling = real and world == 1
    if cfg.resample == "extend" and not cfg.dynamic_sampling:
        p.error("--resample extend is a kind of dynamic sampling, which is off: add --dynamic-sampling")
    if cfg.mini_batch_size is None and real:
        cfg.mini_batch_size = max(world, cfg.batch_size * cfg.group_size // 4 // world * world)
    return cfg


def stage_steps(cfg: Config) -> int:
    """Steps per horizon stage: --schedule-every, else the steps shared evenly among the stages."""
    return cfg.schedule_every or max(1, -(-cfg.steps // len(cfg.schedule.split(","))))


# ================================================================ setup
@dataclasses.dataclass
class Run:
    """Everything a step needs, made once by `setup`: models, optimizers, engine, schedule, data."""
    cfg: Config
    url: str
    server: object  # the local env server (env_server.app.ServerProcess), or None with --env-addr
    device: torch.device
    tokenizer: object
    fmt: ChatFormat
    pad: int
    model: torch.nn.Module  # the fp32 master weights: the optimizer's and the checkpoint's
    prec: Precision  # prec.model computes (generation, forward, backward): the master, or its bf16 copy
    ref: torch.nn.Module | None  # the KL reference (the initial policy), with --kl-coef
    critic: torch.nn.Module | None  # with an estimator that needs one (PPO)
    optims: dict
    engine: object
    schedule: object
    data_rng: random.Random  # the same on every rank: all ranks draw the same tasks
    sample_gen: torch.Generator  # this rank's sampling stream
    pool: EnvPool
    train_ids: list[int]
    test_ids: list[int]
    categories: dict
    threads: int  # torch threads during rollouts (the env server needs a core)
    update_threads: int  # and during the update, which makes no env call
    start: int = 1  # the first step to play (after a checkpoint's)
    evals: list = dataclasses.field(default_factory=list)  # the held-out evaluations so far
    safe: tuple = (0, None)  # (step, its snapshot): what a stop saves, with the weights as they are
    saved: int = 0  # the step of the checkpoint on disk
    lr_scale: float = 1.0  # halved by the --max-update-kl guard
    reporter: object = None  # report.Reporter (rank 0; --report-to)
    show: object = lambda text: None  # shows what the step is doing now on the progress bar (rank 0)


def setup(cfg: Config, url: str, server, device, ckpt: str | None) -> Run:
    tasks = task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
    train_ids = tasks["splits"].get("train")
    if not train_ids:
        sys.exit(f"no training tasks at {url}" + (f" in --tasks-file {cfg.tasks_file}" if cfg.tasks_file else ""))
    init_path = resolve(cfg.model, cfg.env, cfg.cache_dir)  # the initial policy, and the KL reference
    model_path = os.path.join(ckpt, "model") if ckpt else init_path
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, dtype=None).train()
    dtype = compute_dtype(cfg, device, model)
    model = prepare(model, device, cfg.grad_checkpointing, dtype)
    prec = Precision(model, dtype if world_size() == 1 else torch.float32)  # FSDP casts for itself
    ref = None
    if cfg.kl_coef > 0:  # never trained: no master weights needed
        ref = (load_model(init_path, device, dtype).eval() if world_size() == 1
               else prepare(load_model(init_path, dtype=None).eval(), device, dtype=dtype))
    critic = prepare(Critic(model_path), device, cfg.grad_checkpointing) if algos.estimator(cfg.algo).critic else None
    optims = {"policy": torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)}
    if critic is not None:
        optims["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
    run = Run(cfg=cfg, url=url, server=server, device=device, tokenizer=tokenizer, fmt=ChatFormat(tokenizer),
              pad=pad_id(tokenizer), model=model, prec=prec, ref=ref, critic=critic, optims=optims,
              engine=engine_for(cfg, prec.model, model_path, pad_id(tokenizer), device, dtype),
              schedule=make_schedule(cfg.schedule, stage_steps(cfg), cfg.schedule_kind),
              data_rng=random.Random(cfg.seed),
              sample_gen=None,
              pool=EnvPool(url, cfg.batch_size // world_size() * cfg.group_size, timeout=cfg.env_timeout),
              train_ids=train_ids, test_ids=spread(tasks["splits"].get("test", []), cfg.eval_tasks),
              categories=tasks["categories"], threads=torch.get_num_threads(),
              update_threads=cpu_threads(cfg.threads, leave_one=False))
    kind = "hf" if isinstance(run.engine, HFEngine) else "vllm"
    run.sample_gen = torch.Generator(sampling_device(kind, device)).manual_seed(cfg.seed + global_rank())
    if ckpt:
        resume(run, ckpt)
    return run


def engine_for(cfg: Config, model, model_path: str, pad: int, device, dtype: torch.dtype):
    """The generation engine --engine names (auto: engines.resolve_engine). vLLM loads `model_path`'s
    weights itself, in the compute dtype, with a KV cache for the larger of a step's and (where the run
    evaluates) an evaluation's episodes."""
    kind = resolve_engine(cfg.engine, model_path, device)
    batch = max(cfg.batch_size // world_size() * cfg.group_size, cfg.eval_batch if cfg.eval_every else 0)
    try:
        engine = make_engine(kind, model, model_path, pad, batch=batch, max_model_len=cfg.max_context,
                             dtype=str(dtype).removeprefix("torch."), seed=cfg.seed,
                             gpu_memory_utilization=cfg.vllm_gpu_memory, enforce_eager=cfg.vllm_eager,
                             kv_cache_tokens=cfg.vllm_kv_tokens)
    except ImportError as e:
        sys.exit(str(e))
    if kind == "vllm" and global_rank() == 0:
        print(f"vLLM engine started in {engine.start_s:.0f} s", flush=True)
    return engine


def compute_dtype(cfg: Config, device: torch.device, model: torch.nn.Module) -> torch.dtype:
    """--dtype (policy.resolve_dtype: auto is bf16 for a real model where the hardware computes it
    natively); under torchrun on CPU always fp32: FSDP's mixed precision is used on CUDA only."""
    if world_size() > 1 and device.type != "cuda":
        return torch.float32
    return resolve_dtype(cfg.dtype, device, model)


def resume(run: Run, ckpt: str) -> None:
    """The checkpoint's optimizer, critic, schedule and random states into `run`; logs past it are cut."""
    cfg, rank, world = run.cfg, global_rank(), world_size()
    try:
        st = load_checkpoint(ckpt, run.model, run.critic, run.optims)
    except ValueError as e:
        sys.exit(f"--resume: {e}")
    run.prec.sync()
    run.schedule.load_state_dict(st["schedule"])
    run.data_rng.setstate(st["data_rng"])
    run.lr_scale = st.get("lr_scale", 1.0)
    rngs = st["rank_rngs"]
    if len(rngs) == world and st["device_type"] == run.sample_gen.device.type:
        run.sample_gen.set_state(rngs[rank]["sample_gen"])
        torch.set_rng_state(rngs[rank]["torch_rng"])
    else:  # another number of ranks: same data order, new sampling streams
        if rank == 0:
            print(f"resuming {len(rngs)} {st['device_type']} rank(s) as {world} {run.sample_gen.device.type} "
                  "rank(s): the tasks continue in order, sampling from new seeds", flush=True)
        run.sample_gen.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
        torch.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
    run.start = st["step"] + 1
    if rank == 0:
        truncate_logs(cfg.out, st["step"])
    if os.path.exists(os.path.join(cfg.out, "eval.jsonl")):  # the evaluations before the stop
        with open(os.path.join(cfg.out, "eval.jsonl")) as f:
            run.evals = [json.loads(x) for x in f if x.strip()]


# ================================================================ one step
def play(run: Run, step: int) -> tuple[list[Trajectory], list[Trajectory], dict]:
    """The rollout: this rank's whole groups of the step's tasks at the horizon K; then every rank's
    trajectories, in rank order (logged by rank 0), and the step's rollout metrics over all of them."""
    cfg, rank, world = run.cfg, global_rank(), world_size()
    K = run.schedule.max_turns(step)
    rcfg = RolloutConfig(max_turns=K, max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context,
                         temperature=cfg.temperature, top_p=cfg.top_p)
    chosen = run.data_rng.sample(run.train_ids, min(cfg.batch_size, len(run.train_ids)))
    item_ids, groups = rank_items(chosen, cfg.batch_size, cfg.group_size, rank, world)
    t0 = time.time()

    rounds = iter(["rollout"] + [f"resample {r}" for r in range(1, cfg.max_resample + 1)])

    def play_groups(item_ids, groups):
        what = next(rounds)
        with generating(run.engine, run.prec.model):
            return rollout(EnginePolicy(run.engine, run.fmt, rcfg, run.sample_gen), run.pool, cfg.env, item_ids,
                           groups, rcfg, fmt=run.fmt, agent=cfg.agent,
                           progress=lambda turn, ended, n: run.show(f"{what} turn {turn}/{K}, {ended}/{n} ended"))

    trajs = play_groups(item_ids, groups)
    everyone = all_gather_list(trajs)
    m = rollout_metrics(everyone, K, 0.0)  # outcomes of the step's own tasks, with or without resampling
    if cfg.dynamic_sampling:
        trajs, extra = resample(run, trajs, play_groups)
        everyone = everyone + extra
        m.update(resampled_groups=len({t.group for t in extra}), trained_groups=len({t.group for t in trajs}))
    time_rollout = time.time() - t0
    m.update(time_rollout_s=time_rollout,
             tokens_per_s=sum(sum(t.loss_mask) for t in everyone) / max(time_rollout, 1e-9))
    if rank == 0:
        write_log(os.path.join(cfg.out, "rollouts", f"step_{step:06d}.jsonl"), step, K, everyone)
    return trajs, everyone, m


def resample(run: Run, trajs: list[Trajectory], play_groups) -> tuple[list[Trajectory], list[Trajectory]]:
    """Dynamic sampling: groups whose scores all tie carry no signal, so up to --max-resample extra rounds
    are played until the update sees --batch-size informative groups (fewer when the rounds run out).
    --resample fresh (DAPO) drops a tied group and plays a fresh task in its place, under a new group id;
    --resample extend plays the tied group's own task --group-size more times under the same id, so that a
    task solved 1 time in 8 still shows its win. Returns (the trajectories to train on, the extra ones)."""
    cfg = run.cfg
    keep = informative_groups(trajs)
    kept = [t for t in trajs if t.group in keep]
    tied = {t.group: t.item_id for t in trajs if t.group not in keep}  # group -> its task
    extra, next_group = [], max(t.group for t in trajs) + 1
    for _ in range(cfg.max_resample):
        missing = cfg.batch_size - len({t.group for t in kept})
        if missing <= 0 or not tied:
            break
        if cfg.resample == "extend":  # the tied groups' own tasks again, under their own ids
            groups = [g for g in sorted(tied) for _ in range(cfg.group_size)]
            item_ids = [tied[g] for g in groups]
        else:
            fresh = run.data_rng.sample(run.train_ids, min(missing, len(run.train_ids)))
            item_ids, groups = rank_items(fresh, len(fresh), cfg.group_size)
            groups, next_group = [next_group + g for g in groups], next_group + len(fresh)
        extra += play_groups(item_ids, groups)
        played = [t for t in trajs + extra if t.group in groups]  # a grown group: both its rounds
        keep = informative_groups(played)
        kept += [t for t in played if t.group in keep]
        if cfg.resample == "extend":  # (fresh: a new task is drawn each round while groups are missing)
            tied = {t.group: t.item_id for t in played if t.group not in keep}
    return kept, extra


def set_lr(run: Run, step: int) -> float:
    """Put this step's learning rates (lr_at) into the optimizers; returns the policy's."""
    cfg = run.cfg
    share = lr_at(step, cfg.steps, cfg.lr_decay, cfg.warmup_steps or 0) * run.lr_scale
    for name, o in run.optims.items():
        for g in o.param_groups:
            g["lr"] = share * (cfg.lr if name == "policy" else cfg.critic_lr)
    return share * cfg.lr


def guard(run: Run, step: int, m: dict) -> None:
    """--max-update-kl: a step whose update moved the policy further than the bound halves the learning
    rate of the steps after it (run.lr_scale, kept in checkpoints)."""
    bound = run.cfg.max_update_kl
    if bound and m.get("update_kl") is not None and m["update_kl"] > bound:
        run.lr_scale *= 0.5
        tqdm.write(f"step {step}: update_kl {m['update_kl']:.2e} > --max-update-kl {bound:g}: learning rate halved "
                   f"to {run.lr_scale:g} x the schedule's from step {step + 1}")
    m["lr_scale"] = run.lr_scale


def train_step(run: Run, step: int, intr: Interrupts) -> dict:
    """One step: rollout -> advantages and update -> new weights to the engine -> one line of metrics."""
    cfg = run.cfg
    trajs, everyone, m = play(run, step)
    kept = [t for t in trajs if t.status != "env_error"]  # infrastructure failures are not rewards
    errors, played = m["status_env_error"], sum(v for k, v in m.items() if k.startswith("status_"))
    # Too many env errors: what is left is a biased sample (say, only the short episodes); not trained on.
    m["bad"] = errors > cfg.max_env_error_share * played
    if not m["bad"]:  # a plateau schedule watches success; a biased sample would mislead it
        run.schedule.observe(step, m["success_rate"])
    with intr.critical():  # a signal here waits: never save half an update
        t1 = time.time()
        if played > errors and not m["bad"] and (kept or world_size() > 1):  # collective under torchrun
            m["lr"] = set_lr(run, step)
            run.show(f"update of {len(kept)} trajectories")
            torch.set_num_threads(run.update_threads)
            try:
                m.update(update(run, kept))
            finally:
                torch.set_num_threads(run.threads)
        m["time_update_s"] = time.time() - t1
        m["skipped_update"] = int("loss" not in m)
        guard(run, step, m)
        m["time_sync_s"] = float(run.engine.sync_weights(run.prec.model) or 0.0)  # HF: the same module, nothing to copy
        if run.device.type == "cuda":
            m["peak_gpu_mb"] = torch.cuda.max_memory_allocated(run.device) / 2**20
        m["step"] = step
        if global_rank() == 0:
            with open(os.path.join(cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({k: v for k, v in m.items() if k != "bad"}) + "\n")
            run.reporter.log("train", m, step)
        run.safe = (step, snapshot(run))  # before the critical section ends: a signal held back by it is
        # raised as it ends, and the checkpoint it saves must be this step's, whose weights these are
    m["first_error"] = next((t.error for t in everyone if t.status == "env_error"), None)
    return m


# ================================================================ the loop
def main(cfg: Config) -> dict:
    rank, world, device = init_distributed(cfg.device)
    try:
        if cfg.out is None:  # rank 0's clock names the run
            cfg.out = broadcast_value(os.path.join(
                "runs", f"{cfg.env}__{cfg.algo}__{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"))
        ckpt = find_checkpoint(cfg.out) if cfg.resume else None  # parse_args made sure there is one
        if rank == 0:
            print(f"run folder: {cfg.out}" + (f" (resuming from {ckpt})" if ckpt else ""), flush=True)
        with serving(cfg.env, cfg.env_addr) as (url, server):  # one per rank (distributed.py)
            task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)  # refused before any build
            if not cfg.resume:  # build what --model names (the warm start, a wheel's model) once, before any write
                if rank == 0:
                    torch.set_num_threads(cpu_threads(cfg.threads, leave_one=False))
                    try:
                        resolve(cfg.model, cfg.env, cfg.cache_dir)
                    except RuntimeError as e:
                        sys.exit(f"--model {cfg.model}: {e}")
                barrier()
            random.seed(cfg.seed)  # after any build, which seeds and draws for itself: a run with the model
            torch.manual_seed(cfg.seed)  # cached is the same run as the one that built it
            torch.set_num_threads(cpu_threads(cfg.threads))  # one process per GPU under torchrun: distributed.py
            run = setup(cfg, url, server, device, ckpt)
            if rank == 0:  # the run's first writes, after every check (a refused start leaves no config.json)
                os.makedirs(cfg.out, exist_ok=True)
                with open(os.path.join(cfg.out, "config.json"), "w") as f:
                    json.dump(dataclasses.asdict(cfg), f, indent=2)
            run.reporter = make_reporter(cfg.report_to if rank == 0 else "none", cfg.out, dataclasses.asdict(cfg))
            try:
                return loop(run)
            finally:
                run.pool.close()
                run.reporter.close()
    finally:
        if world > 1:
            dist.destroy_process_group()


def loop(run: Run) -> dict:
    """Steps from run.start to --steps, with held-out evaluations and checkpoints; Ctrl-C or SIGTERM stops
    with a checkpoint (checkpoints.Interrupts) that --resume continues exactly."""
    cfg, rank, world = run.cfg, global_rank(), world_size()
    t_start, last, bad_steps = time.time(), {}, 0
    run.safe, run.saved = (run.start - 1, snapshot(run)), run.start - 1
    bar = tqdm(range(run.start, cfg.steps + 1), desc=f"{cfg.env} {cfg.algo}", initial=run.start - 1, total=cfg.steps,
               dynamic_ncols=True, disable=rank != 0)
    shown = [""]  # the last step's figures, kept in front of what the step now playing is doing
    if rank == 0:
        run.show = lambda text: bar.set_postfix_str(", ".join(x for x in (shown[0], text) if x))
    try:
        with Interrupts(defer_all=world > 1) as intr:
            try:
                before = run.start - 1  # evaluate the starting policy, or an evaluation a stop cut short
                if before == 0 or (eval_due(cfg, before) and before not in [e["step"] for e in run.evals]):
                    evaluate(run, before)
                for step in bar:
                    run.safe = (step - 1, snapshot(run))  # a stop in this step's rollout replays the step on resume
                    env_ready(run.server, run.url, cfg.env_wait if bad_steps else 0.0)
                    last = train_step(run, step, intr)  # sets run.safe to this step once its update is made
                    shown[0] = (f"K={last['max_turns']}, reward={last['reward_mean']:.2f}, "
                                f"success={last['success_rate']:.2f}")
                    run.show("")
                    bad_steps = bad_steps + 1 if last.pop("bad") else 0
                    if bad_steps:
                        too_many_env_errors(run, step, last, bad_steps, intr)
                    if eval_due(cfg, step):
                        evaluate(run, step)
                    if cfg.save_every >= 0 and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)):
                        with intr.critical():
                            save(run, *run.safe)
                    if world > 1 and all_max(int(intr.signum is not None)):  # the ranks stop together
                        raise KeyboardInterrupt
            except KeyboardInterrupt:
                stop(run, intr)
    finally:
        bar.close()
    last.pop("first_error", None)
    return last if rank != 0 else {**last, **finish(run, time.time() - t_start)}


def eval_due(cfg: Config, step: int) -> bool:
    return step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


def evaluate(run: Run, step: int) -> None:
    """Held-out evaluation (eval.held_out): every rank plays its share of the test tasks; rank 0 writes."""
    cfg = run.cfg
    if not (cfg.eval_every and run.test_ids):
        return
    rcfg = RolloutConfig(max_turns=cfg.eval_turns or max(int(k) for k in cfg.schedule.split(",")),
                         max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context, temperature=cfg.temperature,
                         top_p=cfg.top_p)
    gen = torch.Generator(run.sample_gen.device).manual_seed(cfg.seed + 12345 + global_rank())  # the same each time
    with generating(run.engine, run.prec.model):
        r = held_out(run.engine, run.fmt, run.url, cfg.env, run.test_ids, rcfg, step, gen, cfg.eval_batch,
                     cfg.env_timeout, cfg.agent, run.categories, cfg.eval_samples)
    run.evals.append(r)
    if global_rank() == 0:
        with open(os.path.join(cfg.out, "eval.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        run.reporter.log("eval", r, step)
        tqdm.write(f"held-out eval after step {step}: success {r['success_rate']:.3f} on {r['tasks']} test tasks "
                   f"x {r['samples']} (K={rcfg.max_turns}, {r['time_s']:.0f}s)")


def snapshot(run: Run) -> dict:
    """What a run resumed after the last update needs besides weights and optimizer: the schedule and
    this rank's random streams (data order, sampling, torch)."""
    return {"schedule": run.schedule.state_dict(), "data_rng": run.data_rng.getstate(), "lr_scale": run.lr_scale,
            "rng": {"sample_gen": run.sample_gen.get_state(), "torch_rng": torch.get_rng_state()}}


def save(run: Run, step: int, snap: dict) -> None:
    state = {"step": step, "schedule": snap["schedule"], "data_rng": snap["data_rng"], "lr_scale": snap["lr_scale"],
             "rank_rngs": all_gather_list([snap["rng"]]), "device_type": run.sample_gen.device.type,
             "config": dataclasses.asdict(run.cfg)}
    save_checkpoint(run.cfg.out, run.model, run.tokenizer, run.critic, run.optims, state)
    run.saved = step


def stop(run: Run, intr: Interrupts) -> None:
    """After Ctrl-C / SIGTERM: save the last whole step, if not on disk yet, and exit 128 + signal."""
    done, snap = run.safe
    if done > run.saved:
        save(run, done, snap)
    if global_rank() == 0:
        tqdm.write(f"interrupted ({signal.Signals(intr.signum or signal.SIGINT).name}): " +
                   (f"checkpoint at step {run.saved} in {run.cfg.out}; continue with: {resume_command(run.cfg.out)}"
                    if run.saved else "stopped before the first step ended; nothing to save"))
    sys.exit(128 + (intr.signum or signal.SIGINT))


def too_many_env_errors(run: Run, step: int, m: dict, bad_steps: int, intr: Interrupts) -> None:
    """A step that was not trained on for env errors; after --env-error-patience of them in a row, stop
    with a checkpoint."""
    cfg = run.cfg
    tqdm.write(f"step {step}: {m['status_env_error']} trajectories hit env errors, above --max-env-error-share "
               f"{cfg.max_env_error_share:g}: not trained on. First: {m['first_error']}")
    if bad_steps >= cfg.env_error_patience:
        with intr.critical():
            save(run, *run.safe)
        sys.exit(f"stopping: {bad_steps} steps in a row had more than {cfg.max_env_error_share:.0%} env-error "
                 f"trajectories (--max-env-error-share, --env-error-patience). Last error: {m['first_error']}\n"
                 f"The checkpoint at step {step} is in {cfg.out}; fix the env server and continue with: "
                 f"{resume_command(cfg.out)}")


def finish(run: Run, seconds: float) -> dict:
    """The end of a run: a short table on the terminal, and every number in OUT/summary.json."""
    cfg = run.cfg
    evals = [e for e in run.evals if e["tasks"]]  # an evaluation the env server failed has no result
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    k = max(1, min(5, len(rows) // 2))
    mean = lambda rs, key: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    out = {"steps": len(rows), "minutes": seconds / 60, "out": cfg.out,
           "train_success_first": mean(rows[:k], "success_rate"), "train_success_last": mean(rows[-k:], "success_rate")}
    table = [(f"training success (mean of {k} step{'s' * (k != 1)})", out["train_success_first"],
              out["train_success_last"])]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        for key, name in (("success_rate", "eval_success"), ("step", "eval_step"), ("by_category", "eval_by_category")):
            out.update({f"{name}_start": a[key], f"{name}_end": b[key]})
        out.update(guess_share_start=a.get("guess_share", 0.0), guess_share_end=b.get("guess_share", 0.0))
        table.append((f"held-out success, step {a['step']} -> {b['step']} ({b['tasks']} tasks x "
                       f"{b.get('samples', 1)}, K={b['max_turns']})", a["success_rate"], b["success_rate"]))
        if out["guess_share_start"] or out["guess_share_end"]:  # the built-in warm start's planted habit
            table.append(("opening with the warm start's habit", out["guess_share_start"], out["guess_share_end"]))
        table += [(f"  {c}", a["by_category"].get(c, float("nan")), v) for c, v in b["by_category"].items()]
    w = max(len(r[0]) for r in table)
    print(f"\nrun {cfg.out}: {len(rows)} steps in {seconds / 60:.1f} min\n  {'':{w}}  start    end", flush=True)
    for name, x, y in table:
        print(f"  {name:{w}}  {x:5.3f}  {y:5.3f}  {100 * (y - x):+6.1f} points")
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"  every number: {os.path.join(cfg.out, 'summary.json')}; curves: python plot.py {cfg.out}", flush=True)
    return out


if __name__ == "__main__":
    main(parse_args())
