"""The run around train.py's loop, each piece called there at one named point: setup (models,
optimizers, engine, env server and pool, tasks), --resume from a checkpoint, the progress bar,
held-out evaluations, checkpoints and signals (Ctrl-C or SIGTERM saves a checkpoint that --resume
continues exactly), dynamic sampling, the env-error rules, the learning-rate schedule and its
--max-update-kl guard, the metrics files and reporters, and the summary at the end.

The run folder (--out) holds config.json, metrics.jsonl, eval.jsonl, rollouts/, summary.json and
checkpoint/ (README, "Flags and the run folder").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import algos
from engines import HFEngine, make_engine, resolve_engine, sampling_device
from env_client import EnvPool
from trainer.tasks import env_ready, spread
from env_server.process import serving
from eval import held_out
from models.builtin import resolve
from models.fast_hf import FastHFEngine
from models.policy import (Critic, Precision, dtype_name, load_model, load_tokenizer, pad_id,
                           prepare, resolve_dtype)
from rollout import ChatFormat, RolloutConfig, Trajectory, outcomes, write_log
from scheduler import horizons, lr_at, make_schedule, stage_steps
from trainer.checkpoints import (Interrupts, find_checkpoint, load_checkpoint, resume_command,
                                 save_checkpoint, truncate_logs)
from trainer.cli import cpu_threads, task_lists
from trainer.config import Config
from trainer.distributed import (all_gather_list, all_max, barrier, broadcast_value, gathered,
                                 global_rank, init_distributed, rank_items, world_size)
from trainer.report import make_reporter


# ================================================================ the named points of train.py
@contextlib.contextmanager
def started(cfg: Config):
    """The run, set up (train.py's `with layer.started(cfg) as run`): torchrun joined, the env
    server started (or --env-addr checked), what --model names built once, models and engine loaded,
    a checkpoint's state restored on --resume, config.json written; signals caught for the loop. On
    Ctrl-C / SIGTERM: a checkpoint and exit; at the end: the summary (run.summary)."""
    rank, world, device = init_distributed(cfg.device)
    try:
        if cfg.out is None:  # rank 0's clock names the run
            cfg.out = broadcast_value(os.path.join(
                "runs", f"{cfg.env}__{cfg.algo}__{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"))
        ckpt = find_checkpoint(cfg.out) if cfg.resume else None  # parse_args made sure there is one
        if rank == 0:
            print(f"run folder: {cfg.out}" + (f" (resuming from {ckpt})" if ckpt else ""),
                  flush=True)
        with serving(cfg.env, cfg.env_addr) as (url, server):  # one per rank (distributed.py)
            # refused before any build
            task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
            # build what --model names (the warm start, a wheel's model) once, before any write
            if not cfg.resume:
                if rank == 0:
                    torch.set_num_threads(cpu_threads(cfg.threads, leave_one=False))
                    try:
                        resolve(cfg.model, cfg.env, cfg.cache_dir)
                    except RuntimeError as e:
                        sys.exit(f"--model {cfg.model}: {e}")
                barrier()
            # after any build, which seeds and draws for itself: a run with the model cached is the
            # same run as the one that built it
            random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            # one process per GPU under torchrun: distributed.py
            torch.set_num_threads(cpu_threads(cfg.threads))
            run = setup(cfg, url, server, device, ckpt)
            # the run's first writes, after every check (a refused start leaves no config.json)
            if rank == 0:
                os.makedirs(cfg.out, exist_ok=True)
                with open(os.path.join(cfg.out, "config.json"), "w") as f:
                    json.dump(dataclasses.asdict(cfg), f, indent=2)
            run.reporter = make_reporter(cfg.report_to if rank == 0 else "none", cfg.out,
                                         dataclasses.asdict(cfg))
            try:
                with Interrupts(defer_all=world > 1) as run.intr:
                    try:
                        yield run
                    except KeyboardInterrupt:
                        stop(run, run.intr)
                run.last.pop("first_error", None)
                run.summary = (run.last if rank != 0
                               else {**run.last, **finish(run, time.time() - run.t_start)})
            finally:
                if run.bar is not None:
                    run.bar.close()
                run.pool.close()
                run.reporter.close()
    finally:
        if world > 1:
            dist.destroy_process_group()


@contextlib.contextmanager
def generating(run_or_engine, model=None):
    """The engine ready to sample: vLLM woken up (weights and KV cache back on the GPU) and put back
    to sleep after, leaving the memory to the update; HF generate with the policy's weights gathered
    (under torchrun each rank generates alone: distributed.gathered)."""
    engine = getattr(run_or_engine, "engine", run_or_engine)
    model = run_or_engine.prec.model if model is None else model
    engine.wake_up()
    try:
        with gathered(model) if isinstance(engine, HFEngine) else contextlib.nullcontext():
            yield
    finally:
        engine.sleep()


def after_rollout(run, step: int, K: int, trajs: list[Trajectory], play, seconds: float):
    """The step's rollout metrics over every rank's trajectories; dynamic sampling (more rounds of
    `play` for the groups whose outcomes all tied); the trajectory log. Returns (this rank's
    trajectories to train on, metrics)."""
    cfg, t0 = run.cfg, time.time() - seconds
    everyone = all_gather_list(trajs)
    # outcomes of the step's own tasks, with or without resampling
    m = rollout_metrics(everyone, K, 0.0)
    if cfg.dynamic_sampling:
        trajs, extra = resample(run, trajs, play)
        everyone = everyone + extra
        m.update(resampled_groups=len({t.group for t in extra}),
                 trained_groups=len({t.group for t in trajs}))
    time_rollout = time.time() - t0
    m.update(time_rollout_s=time_rollout,
             tokens_per_s=sum(sum(t.loss_mask) for t in everyone) / max(time_rollout, 1e-9))
    if global_rank() == 0:
        write_log(os.path.join(cfg.out, "rollouts", f"step_{step:06d}.jsonl"), step, K, everyone)
    errors, played = m["status_env_error"], sum(v for k, v in m.items() if k.startswith("status_"))
    # Too many env errors: what is left is a biased sample (say, only the short episodes); not
    # trained on.
    m["bad"] = errors > cfg.max_env_error_share * played
    if not m["bad"]:  # a plateau schedule watches success; a biased sample would mislead it
        run.schedule.observe(step, m["success_rate"])
    m["first_error"] = next((t.error for t in everyone if t.status == "env_error"), None)
    return trajs, m


def trainable(run, m: dict, kept: list[Trajectory]) -> bool:
    """Whether the step updates: some trajectory without an env error, not too many env errors;
    under torchrun every rank takes part (the update is collective), with or without
    trajectories."""
    errors, played = m["status_env_error"], sum(v for k, v in m.items() if k.startswith("status_"))
    ok = played > errors and not m["bad"] and (kept or world_size() > 1)
    if ok:
        run.show(f"update of {len(kept)} trajectories")
        torch.set_num_threads(run.update_threads)
    return bool(ok)


# ========================================================== step metrics, dynamic sampling's groups
def informative_groups(trajs: list[Trajectory]) -> set[int]:
    """Groups not all of one score (env errors left out): the only ones with GRPO/RLOO signal."""
    scores: dict = {}
    for t in trajs:
        if t.status != "env_error":
            scores.setdefault(t.group, set()).add(t.reward)
    return {g for g, s in scores.items() if len(s) > 1}


def rollout_metrics(trajs: list[Trajectory], K: int, time_rollout: float) -> dict:
    """The step's `outcomes` (statuses as status_*); template checks and speed over all of them."""
    o, kept = outcomes(trajs), [t for t in trajs if t.status != "env_error"]
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    groups = {t.group for t in kept}
    return {"max_turns": K, **{k: o[k] for k in ("reward_mean", "success_rate", "turns_mean")},
            **{f"status_{k}": v for k, v in o["statuses"].items()}, "guess_share": o["guess_share"],
            "template_mismatch": sum(t.template == "mismatch" for t in trajs),
            "groups_informative": len(informative_groups(kept)) / max(1, len(groups)),
            "tokens_per_s": gen_tokens / max(time_rollout, 1e-9), "time_rollout_s": time_rollout}


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
    prec: Precision  # prec.model computes (generation, forward, backward): master or bf16 copy
    compute_dtype: torch.dtype  # prec's, or under torchrun FSDP's mixed precision's (prec: fp32)
    ref: torch.nn.Module | None  # the KL reference (the initial policy), with --kl-coef
    critic: torch.nn.Module | None  # with an estimator that needs one (PPO)
    optims: dict
    engine: object
    schedule: object
    data_rng: random.Random  # the same on every rank: all ranks draw the same tasks
    sample_gen: torch.Generator  # this rank's sampling stream
    update_gen: torch.Generator  # the update's shuffle (vLLM's CPU sampler draws the global RNG)
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
    # shows what the step is doing now on the progress bar (rank 0)
    show: object = lambda text: None
    engine_kind: str = "hf"  # the engine that actually runs (--engine auto resolved): hf or vllm
    intr: object = None  # trainer.checkpoints.Interrupts, while the loop runs
    bar: object = None  # the progress bar (rank 0)
    last: dict = dataclasses.field(default_factory=dict)  # the last step's metrics
    summary: dict = dataclasses.field(default_factory=dict)  # finish()'s, at the end
    t_start: float = 0.0
    bad_steps: int = 0  # steps in a row not trained on for env errors

    # ---------------------------------------------------------------- train.py's named points
    def steps(self):
        """The steps from `start` to --steps behind a progress bar; before the first, the starting
        policy's evaluation; between steps: the env-error rules, evaluations, checkpoints, and
        (under torchrun) the ranks agreeing to stop on a signal."""
        cfg, rank, world = self.cfg, global_rank(), world_size()
        self.t_start = time.time()
        self.safe, self.saved = (self.start - 1, snapshot(self)), self.start - 1
        self.bar = tqdm(range(self.start, cfg.steps + 1), desc=f"{cfg.env} {cfg.algo}",
                        initial=self.start - 1, total=cfg.steps, dynamic_ncols=True,
                        disable=rank != 0)
        shown = [""]  # the last step's figures, kept in front of what the step now playing is doing
        if rank == 0:
            self.show = lambda text: self.bar.set_postfix_str(
                ", ".join(x for x in (shown[0], text) if x))
        before = self.start - 1  # evaluate the starting policy, or an evaluation a stop cut short
        if before == 0 or (eval_due(cfg, before) and before not in [e["step"] for e in self.evals]):
            evaluate(self, before)
        for step in self.bar:
            # a stop in this step's rollout replays the step on resume
            self.safe = (step - 1, snapshot(self))
            env_ready(self.server, self.url, cfg.env_wait if self.bad_steps else 0.0)
            yield step  # train.py plays and updates; run.log sets self.last and self.safe
            last = self.last
            shown[0] = (f"K={last['max_turns']}, reward={last['reward_mean']:.2f}, "
                        f"success={last['success_rate']:.2f}")
            self.show("")
            self.bad_steps = self.bad_steps + 1 if last.pop("bad") else 0
            if self.bad_steps:
                too_many_env_errors(self, step, last, self.bad_steps, self.intr)
            if eval_due(cfg, step):
                evaluate(self, step)
            if cfg.save_every >= 0 and (step == cfg.steps
                                        or (cfg.save_every and step % cfg.save_every == 0)):
                with self.intr.critical():
                    save(self, *self.safe)
            if world > 1 and all_max(int(self.intr.signum is not None)):  # the ranks stop together
                raise KeyboardInterrupt

    def tasks_for_step(self) -> tuple[list[int], list[int]]:
        """--batch-size training tasks drawn for the step (the same on every rank), each
        --group-size times: this rank's share of them as (item ids, group ids)."""
        cfg = self.cfg
        chosen = self.data_rng.sample(self.train_ids, min(cfg.batch_size, len(self.train_ids)))
        return rank_items(chosen, cfg.batch_size, cfg.group_size, global_rank(), world_size())

    def progress(self, K: int):
        """The rollout's progress callback: the turn and how many episodes ended, on the bar."""
        rounds = iter(["rollout"] + [f"resample {r}" for r in range(1, self.cfg.max_resample + 1)])
        state = {}

        def show(turn, ended, n):
            if turn == 1 or "what" not in state:
                state["what"] = next(rounds, "resample")
            self.show(f"{state['what']} turn {turn}/{K}, {ended}/{n} ended")
        return show

    @contextlib.contextmanager
    def critical(self, step: int, m: dict):
        """The update and the weight sync: a signal waits for the end (never save half an
        update)."""
        with self.intr.critical():
            try:
                yield
            finally:
                torch.set_num_threads(self.threads)

    def set_lr(self, step: int) -> float:
        return set_lr(self, step)

    def log(self, step: int, m: dict) -> None:
        """The step's metrics line (metrics.jsonl, reporters), after the --max-update-kl guard; the
        state a stop now saves is this step's (its weights are the engine's)."""
        m["skipped_update"] = int("loss" not in m)
        guard(self, step, m)
        if self.device.type == "cuda":
            m["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        m["step"] = step
        row = {k: v for k, v in m.items() if k not in ("bad", "first_error")}
        if global_rank() == 0:
            with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            self.reporter.log("train", row, step)
        # inside the critical section: a signal held back by it is raised as it ends, and the
        # checkpoint it saves must be this step's
        self.safe = (step, snapshot(self))
        self.last = m


def setup(cfg: Config, url: str, server, device, ckpt: str | None) -> Run:
    tasks = task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
    train_ids = tasks["splits"].get("train")
    if not train_ids:
        sys.exit(f"no training tasks at {url}" + (f" in --tasks-file {cfg.tasks_file}"
                                                  if cfg.tasks_file else ""))
    # the initial policy, and the KL reference
    init_path = resolve(cfg.model, cfg.env, cfg.cache_dir)
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
    critic = (prepare(Critic(model_path), device, cfg.grad_checkpointing)
              if algos.estimator(cfg.algo).critic else None)
    optims = {"policy": torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                          weight_decay=cfg.weight_decay)}
    if critic is not None:
        optims["critic"] = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr,
                                             weight_decay=cfg.weight_decay)
    run = Run(cfg=cfg, url=url, server=server, device=device, tokenizer=tokenizer,
              fmt=ChatFormat(tokenizer), pad=pad_id(tokenizer), model=model, prec=prec, ref=ref,
              critic=critic, optims=optims, compute_dtype=dtype,
              engine=engine_for(cfg, prec.model, model_path, pad_id(tokenizer), device, dtype),
              schedule=make_schedule(cfg.schedule,
                                     stage_steps(cfg.schedule, cfg.steps, cfg.schedule_every),
                                     cfg.schedule_kind),
              data_rng=random.Random(cfg.seed),
              sample_gen=None, update_gen=torch.Generator().manual_seed(cfg.seed + global_rank()),
              pool=EnvPool(url, cfg.batch_size // world_size() * cfg.group_size,
                           timeout=cfg.env_timeout),
              train_ids=train_ids, test_ids=spread(tasks["splits"].get("test", []), cfg.eval_tasks),
              categories=tasks["categories"], threads=torch.get_num_threads(),
              update_threads=cpu_threads(cfg.threads, leave_one=False))
    kind = run.engine_kind = "hf" if isinstance(run.engine, HFEngine) else "vllm"
    run.sample_gen = torch.Generator(sampling_device(kind, device)).manual_seed(
        cfg.seed + global_rank())
    if ckpt:
        resume(run, ckpt)
    return run


def engine_for(cfg: Config, model, model_path: str, pad: int, device, dtype: torch.dtype):
    """The generation engine --engine names (auto: engines.resolve_engine). vLLM loads
    `model_path`'s weights itself, in the compute dtype, with a KV cache for the larger of a step's
    and (where the run evaluates) an evaluation's episodes."""
    kind = resolve_engine(cfg.engine, model_path, device)
    batch = max(cfg.batch_size // world_size() * cfg.group_size,
                cfg.eval_batch if cfg.eval_every else 0)
    try:
        engine = make_engine(kind, model, model_path, pad, batch=batch,
                             max_model_len=cfg.max_context, dtype=dtype_name(dtype),
                             seed=cfg.seed, gpu_memory_utilization=cfg.vllm_gpu_memory,
                             enforce_eager=cfg.vllm_eager, kv_cache_tokens=cfg.vllm_kv_tokens,
                             hf_class=FastHFEngine)
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
    """The checkpoint's optimizer, critic, schedule and random states into `run`; logs past it are
    cut."""
    cfg, rank, world = run.cfg, global_rank(), world_size()
    try:
        st = load_checkpoint(ckpt, run.model, run.critic, run.optims)
        saved = st["schedule"]  # without --schedule-every: the stages the run began with, not
        if cfg.schedule_every is None and saved.get("every"):  # ones from a changed --steps
            run.schedule = make_schedule(cfg.schedule, saved["every"], cfg.schedule_kind)
        run.schedule.load_state_dict(saved)
    except ValueError as e:
        sys.exit(f"--resume: {e}")
    run.prec.sync()
    run.data_rng.setstate(st["data_rng"])
    run.lr_scale = st.get("lr_scale", 1.0)
    rngs = st["rank_rngs"]
    if len(rngs) == world and st["device_type"] == run.sample_gen.device.type:
        run.sample_gen.set_state(rngs[rank]["sample_gen"])
        torch.set_rng_state(rngs[rank]["torch_rng"])
        run.update_gen.set_state(rngs[rank].get("update_gen", run.update_gen.get_state()))
    else:  # another number of ranks: same data order, new sampling streams
        if rank == 0:
            print(f"resuming {len(rngs)} {st['device_type']} rank(s) as {world} "
                  f"{run.sample_gen.device.type} rank(s): the tasks continue in order, sampling "
                  "from new seeds", flush=True)
        for gen in (run.sample_gen, run.update_gen, torch):
            gen.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
    run.start, dtype = st["step"] + 1, dtype_name(run.compute_dtype)
    if rank == 0:
        if st.get("dtype", dtype) != dtype:  # --dtype auto follows the hardware, not the run
            print(f"resuming a {st['dtype']} run in {dtype} (--dtype {cfg.dtype} here)", flush=True)
        truncate_logs(cfg.out, st["step"])
    if os.path.exists(os.path.join(cfg.out, "eval.jsonl")):  # the evaluations before the stop
        with open(os.path.join(cfg.out, "eval.jsonl")) as f:
            run.evals = [json.loads(x) for x in f if x.strip()]


def resample(run: Run, trajs: list[Trajectory],
             play_groups) -> tuple[list[Trajectory], list[Trajectory]]:
    """Dynamic sampling: groups whose scores all tie carry no signal, so up to --max-resample extra
    rounds are played until the update sees --batch-size informative groups (fewer when the rounds
    run out). --resample fresh (DAPO) drops a tied group and plays a fresh task in its place, under
    a new group id; --resample extend plays the tied group's own task --group-size more times under
    the same id, so that a task solved 1 time in 8 still shows its win. Returns (the trajectories to
    train on, the extra ones)."""
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
        # (fresh: a new task is drawn each round while groups are missing)
        if cfg.resample == "extend":
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
    """--max-update-kl: a step whose update moved the policy further than the bound halves the
    learning rate of the steps after it (run.lr_scale, kept in checkpoints)."""
    bound = run.cfg.max_update_kl
    if bound and m.get("update_kl") is not None and m["update_kl"] > bound:
        run.lr_scale *= 0.5
        tqdm.write(f"step {step}: update_kl {m['update_kl']:.2e} > --max-update-kl {bound:g}: "
                   f"learning rate halved to {run.lr_scale:g} x the schedule's from step "
                   f"{step + 1}")
    m["lr_scale"] = run.lr_scale


def eval_due(cfg: Config, step: int) -> bool:
    return step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


def evaluate(run: Run, step: int) -> None:
    """Held-out evaluation (eval.held_out): every rank plays its share of the test tasks; rank 0
    writes."""
    cfg = run.cfg
    if not (cfg.eval_every and run.test_ids):
        return
    rcfg = RolloutConfig.of(cfg, cfg.eval_turns or max(horizons(cfg.schedule)))
    # the same each time
    gen = torch.Generator(run.sample_gen.device).manual_seed(cfg.seed + 12345 + global_rank())
    with generating(run.engine, run.prec.model):
        r = held_out(run.engine, run.fmt, run.url, cfg.env, run.test_ids, rcfg, step, gen,
                     cfg.eval_batch, cfg.env_timeout, cfg.agent, run.categories, cfg.eval_samples)
    run.evals.append(r)
    if global_rank() == 0:
        with open(os.path.join(cfg.out, "eval.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        run.reporter.log("eval", r, step)
        tqdm.write(f"held-out eval after step {step}: success {r['success_rate']:.3f} on "
                   f"{r['tasks']} test tasks x {r['samples']} (K={rcfg.max_turns}, "
                   f"{r['time_s']:.0f}s)")


def snapshot(run: Run) -> dict:
    """What a run resumed after the last update needs besides weights and optimizer: the schedule
    and this rank's random streams (data order, sampling, the update's shuffle, torch)."""
    return {"schedule": run.schedule.state_dict(), "data_rng": run.data_rng.getstate(),
            "lr_scale": run.lr_scale, "rng": {"sample_gen": run.sample_gen.get_state(),
                                              "update_gen": run.update_gen.get_state(),
                                              "torch_rng": torch.get_rng_state()}}


def save(run: Run, step: int, snap: dict) -> None:
    state = {"step": step, "schedule": snap["schedule"], "data_rng": snap["data_rng"],
             "lr_scale": snap["lr_scale"], "rank_rngs": all_gather_list([snap["rng"]]),
             "device_type": run.sample_gen.device.type, "dtype": dtype_name(run.compute_dtype),
             "config": dataclasses.asdict(run.cfg)}
    save_checkpoint(run.cfg.out, run.model, run.tokenizer, run.critic, run.optims, state)
    run.saved = step


def stop(run: Run, intr: Interrupts) -> None:
    """After Ctrl-C / SIGTERM: save the last whole step, if not on disk yet, and exit 128 +
    signal."""
    done, snap = run.safe
    if done > run.saved:
        save(run, done, snap)
    if global_rank() == 0:
        tqdm.write(f"interrupted ({signal.Signals(intr.signum or signal.SIGINT).name}): " +
                   (f"checkpoint at step {run.saved} in {run.cfg.out}; continue with: "
                    f"{resume_command(run.cfg.out)}"
                    if run.saved else "stopped before the first step ended; nothing to save"))
    sys.exit(128 + (intr.signum or signal.SIGINT))


def too_many_env_errors(run: Run, step: int, m: dict, bad_steps: int, intr: Interrupts) -> None:
    """A step that was not trained on for env errors; after --env-error-patience of them in a row,
    stop with a checkpoint."""
    cfg = run.cfg
    tqdm.write(f"step {step}: {m['status_env_error']} trajectories hit env errors, above "
               f"--max-env-error-share {cfg.max_env_error_share:g}: not trained on. First: "
               f"{m['first_error']}")
    if bad_steps >= cfg.env_error_patience:
        with intr.critical():
            save(run, *run.safe)
        sys.exit(f"stopping: {bad_steps} steps in a row had more than "
                 f"{cfg.max_env_error_share:.0%} env-error trajectories (--max-env-error-share, "
                 f"--env-error-patience). Last error: {m['first_error']}\n"
                 f"The checkpoint at step {step} is in {cfg.out}; fix the env server and continue "
                 f"with: {resume_command(cfg.out)}")


def finish(run: Run, seconds: float) -> dict:
    """The end of a run: a short table on the terminal, and every number in OUT/summary.json."""
    cfg = run.cfg
    evals = [e for e in run.evals if e["tasks"]]  # one the env server failed has no result
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    k = max(1, min(5, len(rows) // 2))
    mean = lambda rs, key: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    out = {"steps": len(rows), "minutes": seconds / 60, "out": cfg.out,
           "dtype": dtype_name(run.compute_dtype),  # what --dtype resolved to here
           "train_success_first": mean(rows[:k], "success_rate"),
           "train_success_last": mean(rows[-k:], "success_rate")}
    table = [(f"training success (mean of {k} step{'s' * (k != 1)})", out["train_success_first"],
              out["train_success_last"])]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        for key, name in (("success_rate", "eval_success"), ("step", "eval_step"),
                          ("by_category", "eval_by_category")):
            out.update({f"{name}_start": a[key], f"{name}_end": b[key]})
        out.update(guess_share_start=a.get("guess_share", 0.0),
                   guess_share_end=b.get("guess_share", 0.0))
        table.append((f"held-out success, step {a['step']} -> {b['step']} ({b['tasks']} tasks x "
                       f"{b.get('samples', 1)}, K={b['max_turns']})", a["success_rate"],
                      b["success_rate"]))
        # the built-in warm start's planted habit
        if out["guess_share_start"] or out["guess_share_end"]:
            table.append(("opening with the warm start's habit", out["guess_share_start"],
                          out["guess_share_end"]))
        table += [(f"  {c}", a["by_category"].get(c, float("nan")), v)
                  for c, v in b["by_category"].items()]
    w = max(len(r[0]) for r in table)
    print(f"\nrun {cfg.out}: {len(rows)} steps in {seconds / 60:.1f} min\n  {'':{w}}  start    end",
          flush=True)
    for name, x, y in table:
        print(f"  {name:{w}}  {x:5.3f}  {y:5.3f}  {100 * (y - x):+6.1f} points")
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"  every number: {os.path.join(cfg.out, 'summary.json')}; curves: python -m tools.plot "
          f"{cfg.out}", flush=True)
    return out
