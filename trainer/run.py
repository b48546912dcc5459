"""The run around train.py's loop, each piece called there at one named point: setup (models,
optimizers, engine, env server and pool, tasks), --resume from a checkpoint, the progress bar,
held-out evaluations, checkpoints and signals (Ctrl-C or SIGTERM saves a checkpoint that --resume
continues exactly), the stop after too many env-error steps in a row, the metrics files and
reporters, and the summary at the end. Nothing here changes what a step computes: which
trajectories are trained on, the learning rate and the weight sync are written in train.py.

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
from env_client import EnvError, EnvPool, Transport
from trainer.tasks import spread
from eval import held_out
from models.builtin import resolve
from models.policy import (Critic, Precision, dtype_name, load_model, load_tokenizer, pad_id,
                           prepare, resolve_dtype)
from rollout import (ChatFormat, RolloutConfig, Trajectory, informative_groups, outcomes,
                     write_log)
from scheduler import horizons, make_schedule, stage_steps
from trainer.checkpoints import (Interrupts, find_checkpoint, load_checkpoint, previous_minutes,
                                 read_log, resume_command, save_checkpoint, truncate_logs)
from trainer.cli import cpu_threads, serving_env, task_lists
from trainer.config import Config, check_context
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
        with serving_env(cfg.env, cfg.env_addr) as (url, server):  # one per rank (distributed.py)
            # refused before any build
            task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
            # build what --model names (the warm start, a wheel's model) once, before any write
            if not cfg.resume:
                if rank == 0:
                    torch.set_num_threads(cpu_threads(cfg.threads, leave_one=False))
                    built(cfg)
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
                    except Exception as e:  # a bug, a full disk, ...: the last whole step saved
                        crashed(run, e)
                        raise
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
        sharded = world_size() > 1 and isinstance(engine, HFEngine)  # FSDP shards the HF policy
        with gathered(model) if sharded else contextlib.nullcontext():
            yield
    finally:
        engine.sleep()


def log_rollout(run, step: int, K: int, played: list[Trajectory], m: dict, seconds: float):
    """The rollout's time and speed into the step's metrics `m`, the first env error's text, and
    every trajectory played (dynamic sampling's extra rounds too) into OUT/rollouts/."""
    m.update(time_rollout_s=seconds,
             tokens_per_s=sum(sum(t.loss_mask) for t in played) / max(seconds, 1e-9))
    if global_rank() == 0:
        write_log(os.path.join(run.cfg.out, "rollouts", f"step_{step:06d}.jsonl"), step, K, played)
    m["first_error"] = next((t.error for t in played if t.status == "env_error"), None)


def rollout_metrics(trajs: list[Trajectory], K: int, time_rollout: float = 0.0) -> dict:
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
    minutes_before: float = 0.0  # the run's minutes up to its checkpoint (--resume)
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
    def critical(self):
        """The update and the weight sync: a signal waits for the end (never save half an
        update: until run.log, run.safe holds no state); the rollout's threads back after."""
        with self.intr.critical():
            self.safe = (self.safe[0], None)
            try:
                yield
            finally:
                torch.set_num_threads(self.threads)

    def log(self, step: int, m: dict) -> None:
        """The step's metrics line (metrics.jsonl, reporters); the state a stop now saves is this
        step's (its weights are the engine's)."""
        m["skipped_update"] = int("loss" not in m)
        if self.device.type == "cuda":
            m["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        m["step"] = step
        row = {k: v for k, v in m.items() if k not in ("bad", "first_error")}
        if global_rank() == 0:
            with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            self.reporter.log("train", row, step)
        # a signal the critical section held back stops the run after it: with this step saved
        self.safe = (step, snapshot(self))
        self.last = m


def setup(cfg: Config, url: str, server, device, ckpt: str | None) -> Run:
    tasks = task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
    train_ids = tasks["splits"].get("train")
    if not train_ids:
        sys.exit(f"no training tasks at {url}" + (f" in --tasks-file {cfg.tasks_file}"
                                                  if cfg.tasks_file else ""))
    # the initial policy, and the KL reference
    init_path = built(cfg)
    model_path = os.path.join(ckpt, "model") if ckpt else init_path
    tokenizer = load_tokenizer(model_path)
    check_context(cfg, ChatFormat(tokenizer))  # --max-context against the opening prompt
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


def built(cfg: Config) -> str:
    """The folder --model names (models.builtin.resolve), built once into --cache-dir (the tiny
    model's warm start takes minutes): a failed fetch, or Ctrl-C during the build, is one line."""
    try:
        return resolve(cfg.model, cfg.env, cfg.cache_dir)
    except RuntimeError as e:
        sys.exit(f"--model {cfg.model}: {e}")
    except KeyboardInterrupt:
        what = f"--model {cfg.model}" if cfg.model else "the tiny model"
        print(f"Ctrl-C: stopped building {what} in {cfg.cache_dir} (the stages built stay there); "
              "nothing written to the run folder", file=sys.stderr, flush=True)
        sys.exit(130)


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
                             enforce_eager=cfg.vllm_eager, kv_cache_tokens=cfg.vllm_kv_tokens)
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
    run.minutes_before = previous_minutes(cfg.out, st)
    try:
        if rank == 0:
            if st.get("dtype", dtype) != dtype:  # --dtype auto follows the hardware, not the run
                print(f"resuming a {st['dtype']} run in {dtype} (--dtype {cfg.dtype} here)",
                      flush=True)
            truncate_logs(cfg.out, st["step"])
        if os.path.exists(os.path.join(cfg.out, "eval.jsonl")):  # the evaluations before the stop
            run.evals = read_log(os.path.join(cfg.out, "eval.jsonl"))
    except ValueError as e:
        sys.exit(f"--resume: {e}")


def env_ready(server, url: str, wait_s: float) -> None:
    """Before a training step: restart the local env server (an env_server.app.ServerProcess, or
    None) if it died; after a failed step, also wait up to `wait_s` for the server to answer (a
    restart elsewhere takes a while). The pool replaces the lost instances at its next reset."""
    deadline = time.time() + wait_s
    while True:
        if server is not None and not server.alive():
            tqdm.write(f"the env server died (exit code {server.proc.returncode}); restarting it "
                       f"on {server.url}")
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
             "config": dataclasses.asdict(run.cfg), "minutes": minutes(run)}
    save_checkpoint(run.cfg.out, run.model, run.tokenizer, run.critic, run.optims, state)
    run.saved = step


def minutes(run: Run) -> float:
    """The run's minutes so far: every session's, from the start of its first step."""
    return run.minutes_before + (time.time() - run.t_start) / 60


def crashed(run: Run, e: Exception) -> None:
    """An exception in the loop: the last whole step saved if newer than the checkpoint on disk and
    not cut in its update (run.safe holds no state then), and a note on the exception saying how
    to continue. Under torchrun nothing is saved: a save is collective, and the other ranks are not
    at one."""
    done, snap = run.safe
    cfg, world = run.cfg, world_size()
    on_disk = (f"the checkpoint at step {run.saved} is in {cfg.out}; continue with: "
               f"{resume_command(cfg.out)}" if run.saved else "no checkpoint yet")
    if done <= run.saved:
        note = on_disk
    elif world > 1:
        note = f"nothing saved (under torchrun a save needs every rank); {on_disk}"
    elif snap is None:
        note = (f"nothing saved (it came in step {done + 1}'s update, never saved half done); "
                f"{on_disk}")
    else:
        try:
            save(run, done, snap)
            note = (f"the last whole step saved: checkpoint at step {done} in {cfg.out}; continue "
                    f"with: {resume_command(cfg.out)}")
        except Exception as failed:  # the fault may stop the save too (a full disk)
            note = f"saving step {done} failed too ({failed!r}); {on_disk}"
    if global_rank() == 0:
        e.add_note(f"train.py: {note}")


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
    rows = read_log(os.path.join(cfg.out, "metrics.jsonl"))
    k = max(1, min(5, len(rows) // 2))
    mean = lambda rs, key: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    out = {"steps": len(rows), "minutes": run.minutes_before + seconds / 60, "out": cfg.out,
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
    print(f"\nrun {cfg.out}: {len(rows)} steps in {out['minutes']:.1f} min\n  {'':{w}}  start"
          "    end",
          flush=True)
    for name, x, y in table:
        print(f"  {name:{w}}  {x:5.3f}  {y:5.3f}  {100 * (y - x):+6.1f} points")
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"  every number: {os.path.join(cfg.out, 'summary.json')}; curves: python -m tools.plot "
          f"{cfg.out}", flush=True)
    return out
