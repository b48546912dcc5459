"""A training run set up and ended, around trainer/run.py's loop: `started` (train.py's `with
setup.started(cfg) as run`) joins torchrun, starts the env server (or checks --env-addr),
builds what --model names once, loads the models and the engine, restores a checkpoint on
--resume and catches signals; at the end it prints the summary (`finish`). A Ctrl-C or SIGTERM
saves the last whole step (`stop`), and so does a crash where it can (`crashed`).

The run folder (--out) holds config.json, metrics.jsonl, eval.jsonl, rollouts/, summary.json
and checkpoint/ (README, "Flags and the run folder").
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
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm

import algos
from distributed import (Precision, barrier, broadcast_value, global_rank, init_distributed,
                         world_size)
from engines import HFEngine, make_engine, resolve_engine, sampling_device
from env_client import EnvError, EnvPool
from models.builtin import resolve
from models.names import chat_format
from models.policy import (Critic, dtype_name, load_model, load_tokenizer, pad_id, prepare,
                           resolve_dtype)
from scheduler import make_schedule, stage_steps
from tasks import spread
from trainer.checkpoints import (FolderInUse, find_checkpoint, hold_folder, load_checkpoint,
                                 previous_minutes, read_log,
                                 resume_command, truncate_logs)
from trainer.cli import cpu_threads, serving_env, task_lists
from trainer.config import Config, check_context
from trainer.report import make_reporter
from trainer.run import Interrupts, Run, optimizer_steps, save


@contextlib.contextmanager
def started(cfg: Config):
    """The run, set up (train.py's `with layer.started(cfg) as run`): torchrun joined, the env
    server started (or --env-addr checked), what --model names built once, models and engine
    loaded, a checkpoint's state restored on --resume, config.json written; signals caught for
    the loop. On Ctrl-C / SIGTERM: a checkpoint and exit; at the end: the summary
    (run.summary)."""
    rank, world, device = init_distributed(cfg.device)
    ready = False  # until the loop's signal handling takes over, Ctrl-C is one line
    try:
        named = cfg.out is not None
        if cfg.out is None:  # rank 0's clock names the run
            stamp = time.strftime('%Y%m%d-%H%M%S')
            cfg.out = broadcast_value(
                os.path.join("runs", f"{cfg.env}__{cfg.algo}__{cfg.seed}__{stamp}"))
        # parse_args made sure there is one
        ckpt = find_checkpoint(cfg.out) if cfg.resume else None
        if rank == 0:
            print(f"run folder: {cfg.out}" + (f" (resuming from {ckpt})" if ckpt else "")
                  + ("" if named else " (named env__algo__seed__time; --out names it)"),
                  flush=True)
        # one server per rank (distributed.py)
        with serving_env(cfg.env, cfg.env_addr) as (url, server):
            # refused before any build
            task_lists(url, cfg.env, cfg.tasks_file, given=cfg.env_addr is not None)
            # build what --model names (the warm start, a wheel's model) once, before any
            # write
            if not cfg.resume:
                if rank == 0:
                    torch.set_num_threads(cpu_threads(cfg.threads, leave_one=False))
                    built(cfg)
                barrier()
            # after any build, which seeds and draws for itself: a run with the model cached
            # is the same run as the one that built it
            random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            # one process per GPU under torchrun: distributed.py
            torch.set_num_threads(cpu_threads(cfg.threads))
            run = setup(cfg, url, server, device, ckpt)
            # the run's first writes, after every check (a refused start leaves no
            # config.json)
            if rank == 0:
                try:  # one run a folder: a second one started beside it is refused here
                    lock = hold_folder(cfg.out)  # noqa: F841  held while this process lives
                except FolderInUse as e:
                    raise SystemExit(f"train.py: --out {e}: wait for it to end, or give "
                                     "another folder") from None
                with open(os.path.join(cfg.out, "config.json"), "w") as f:
                    json.dump(dataclasses.asdict(cfg), f, indent=2)
            run.reporter = make_reporter(cfg.report_to if rank == 0 else "none", cfg.out,
                                         dataclasses.asdict(cfg))
            try:
                with Interrupts(defer_all=world > 1) as run.intr:
                    ready = True
                    try:
                        yield run
                    except KeyboardInterrupt:
                        stop(run, run.intr)
                    except Exception as e:  # a bug, a full disk: the last whole step saved
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
    except KeyboardInterrupt:
        if ready:
            raise
        print("train.py: interrupted while setting up, before the first step", file=sys.stderr,
              flush=True)
        raise SystemExit(130) from None
    finally:
        if world > 1:
            dist.destroy_process_group()


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
    fmt = chat_format(cfg.model or model_path, tokenizer)  # or exit, naming the template
    check_context(cfg, fmt)  # --max-context against the opening prompt
    model = load_model(model_path, dtype=None).train()
    dtype = compute_dtype(cfg, device, model)
    model = prepare(model, device, cfg.grad_checkpointing, dtype)
    # under torchrun FSDP casts for itself
    prec = Precision(model, dtype if world_size() == 1 else torch.float32)
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
    pad = pad_id(tokenizer)
    every = stage_steps(cfg.schedule, cfg.steps, cfg.schedule_every)
    run = Run(cfg=cfg, url=url, server=server, device=device, tokenizer=tokenizer,
              fmt=fmt, pad=pad, model=model, prec=prec, ref=ref,
              critic=critic, optims=optims, compute_dtype=dtype,
              engine=engine_for(cfg, prec.model, model_path, pad, device, dtype),
              schedule=make_schedule(cfg.schedule, every, cfg.schedule_kind),
              data_rng=random.Random(cfg.seed), sample_gen=None,
              update_gen=torch.Generator().manual_seed(cfg.seed + global_rank()),
              pool=env_pool(url, cfg.batch_size // world_size() * cfg.group_size,
                            cfg.env_timeout),
              train_ids=train_ids,
              test_ids=spread(tasks["splits"].get("test", []), cfg.eval_tasks),
              categories=tasks["categories"], threads=torch.get_num_threads(),
              update_threads=cpu_threads(cfg.threads, leave_one=False))
    kind = run.engine_kind = "hf" if isinstance(run.engine, HFEngine) else "vllm"
    run.sample_gen = torch.Generator(sampling_device(kind, device)).manual_seed(
        cfg.seed + global_rank())
    if ckpt:
        resume(run, ckpt)
    # the log-prob path's check (a forward per model), before the first step, not in it; after
    # the optimizers are made: under FSDP a forward leaves the parameters unsharded
    for m in (prec.model, ref):
        if m is not None:
            algos.head_split_ok(m)
    return run


def env_pool(url: str, size: int, timeout: float) -> EnvPool:
    """The run's instances, or one line: a pool the server has no room for is refused at once
    (env_client.EnvPool), as is one it could not make."""
    try:
        return EnvPool(url, size, timeout=timeout)
    except EnvError as e:
        raise SystemExit(f"train.py: {e.message}") from None


def built(cfg: Config) -> str:
    """The folder --model names (models.builtin.resolve), built once into --cache-dir (the
    tiny model's warm start takes minutes): a failed fetch, or Ctrl-C during the build, is one
    line."""
    try:
        return resolve(cfg.model, cfg.env, cfg.cache_dir)
    except RuntimeError as e:
        sys.exit(f"--model {cfg.model}: {e}")
    except KeyboardInterrupt:
        what = f"--model {cfg.model}" if cfg.model else "the tiny model"
        print(f"Ctrl-C: stopped building {what} in {cfg.cache_dir} (the stages built stay "
              "there); nothing written to the run folder", file=sys.stderr, flush=True)
        sys.exit(130)


def engine_for(cfg: Config, model, model_path: str, pad: int, device, dtype: torch.dtype):
    """The generation engine --engine names (auto: engines.resolve_engine). vLLM loads
    `model_path`'s weights itself, in the compute dtype, with a KV cache for the larger of a
    step's and (where the run evaluates) an evaluation's episodes."""
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
    """--dtype (policy.resolve_dtype: auto is bf16 for a real model where the hardware
    computes it natively); under torchrun on CPU always fp32: FSDP's mixed precision is used
    on CUDA only."""
    if world_size() > 1 and device.type != "cuda":
        return torch.float32
    return resolve_dtype(cfg.dtype, device, model)


def resume(run: Run, ckpt: str) -> None:
    """The checkpoint's optimizer, critic, schedule and random states into `run`; logs past it
    are cut."""
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
    run.bad_steps = st.get("bad_steps", 0)  # the env-error stop counts on
    rngs = st["rank_rngs"]
    if len(rngs) == world and st["device_type"] == run.sample_gen.device.type:
        run.sample_gen.set_state(rngs[rank]["sample_gen"])
        torch.set_rng_state(rngs[rank]["torch_rng"])
        run.update_gen.set_state(rngs[rank].get("update_gen", run.update_gen.get_state()))
    else:  # another number of ranks: same data order, new sampling streams
        if rank == 0:
            print(f"resuming {len(rngs)} {st['device_type']} rank(s) as {world} "
                  f"{run.sample_gen.device.type} rank(s): the tasks continue in order, "
                  "sampling from new seeds", flush=True)
        for gen in (run.sample_gen, run.update_gen, torch):
            gen.manual_seed(cfg.seed + 1_000_003 * st["step"] + rank)
    run.start, dtype = st["step"] + 1, dtype_name(run.compute_dtype)
    run.minutes_before = previous_minutes(cfg.out, st)
    try:
        if rank == 0:
            # --dtype auto follows the hardware, not the run
            if st.get("dtype", dtype) != dtype:
                print(f"resuming a {st['dtype']} run in {dtype} (--dtype {cfg.dtype} here)",
                      flush=True)
            truncate_logs(cfg.out, st["step"])
        if os.path.exists(os.path.join(cfg.out, "eval.jsonl")):  # evaluations before the stop
            run.evals = read_log(os.path.join(cfg.out, "eval.jsonl"))
    except ValueError as e:
        sys.exit(f"--resume: {e}")


def crashed(run: Run, e: Exception) -> None:
    """An exception in the loop: the last whole step saved if newer than the checkpoint on
    disk and not cut in its update after a weight moved (run.safe holds no state in the
    update; run.before_update does until its first optimizer step), and a note on the exception
    saying how to continue. Under torchrun nothing is saved: a save is collective, and the
    other ranks are not at one."""
    done, snap = run.safe
    cfg, world = run.cfg, world_size()
    (kept, kept_snap), steps_then = run.before_update
    if snap is None and kept_snap is not None and optimizer_steps(run.optims) == steps_then:
        done, snap = kept, kept_snap  # it came in an update before any weight moved
    on_disk = (f"the checkpoint at step {run.saved} is in {cfg.out}; continue with: "
               f"{resume_command(cfg.out)}" if run.saved else "no checkpoint yet")
    if done <= run.saved:
        note = on_disk
    elif world > 1:
        note = f"nothing saved (under torchrun a save needs every rank); {on_disk}"
    elif snap is None:
        note = (f"nothing saved (it came in step {done + 1}'s update, never saved half "
                f"done); {on_disk}")
    else:
        try:
            save(run, done, snap)
            note = (f"the last whole step saved: checkpoint at step {done} in {cfg.out}; "
                    f"continue with: {resume_command(cfg.out)}")
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


def finish(run: Run, seconds: float) -> dict:
    """The end of a run: a short table on the terminal, and every number in
    OUT/summary.json."""
    cfg = run.cfg
    evals = [e for e in run.evals if e["tasks"]]  # one the env server failed has no result
    rows = read_log(os.path.join(cfg.out, "metrics.jsonl"))
    k = max(1, min(5, len(rows) // 2))
    mean = lambda rs, key: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    out = {"steps": len(rows), "minutes": run.minutes_before + seconds / 60, "out": cfg.out,
           "dtype": dtype_name(run.compute_dtype),  # what --dtype resolved to here
           "train_success_first": mean(rows[:k], "success_rate"),
           "train_success_last": mean(rows[-k:], "success_rate")}
    first_steps = f"training success (mean of {k} step{'s' * (k != 1)})"
    table = [(first_steps, out["train_success_first"], out["train_success_last"])]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        for key, name in (("success_rate", "eval_success"), ("step", "eval_step"),
                          ("by_category", "eval_by_category")):
            out.update({f"{name}_start": a[key], f"{name}_end": b[key]})
        out.update(guess_share_start=a.get("guess_share", 0.0),
                   guess_share_end=b.get("guess_share", 0.0))
        name = (f"held-out success, step {a['step']} -> {b['step']} ({b['tasks']} tasks x "
                f"{b.get('samples', 1)}, K={b['max_turns']})")
        table.append((name, a["success_rate"], b["success_rate"], b.get("chance")))
        out["eval_chance"] = b.get("chance")  # a random policy's, same tasks and K
        out["eval_chance_by_category"] = b.get("chance_by_category")
        # the built-in warm start's planted habit
        if out["guess_share_start"] or out["guess_share_end"]:
            table.append(("opening with the warm start's habit", out["guess_share_start"],
                          out["guess_share_end"]))
        chance = b.get("chance_by_category") or {}
        table += [(f"  {c}", a["by_category"].get(c, float("nan")), v, chance.get(c))
                  for c, v in b["by_category"].items()]
    w = max(len(r[0]) for r in table)
    print(f"\nrun {cfg.out}: {len(rows)} steps in {out['minutes']:.1f} min\n  {'':{w}}  start"
          "    end                 chance", flush=True)
    for name, x, y, *chance in table:
        beside = f"  {chance[0]:5.3f}" if chance and chance[0] is not None else ""
        print(f"  {name:{w}}  {x:5.3f}  {y:5.3f}  {100 * (y - x):+6.1f} points{beside}")
    if out.get("eval_chance") is not None:
        print("  chance: a random policy (agents.random_moves) on the same tasks and K, "
              f"{b['chance_samples']} samples a task")
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(out, f, indent=2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # from any folder
    print(f"  every number: {os.path.abspath(os.path.join(cfg.out, 'summary.json'))}; curves: "
          f"cd {root} && python -m tools.plot {os.path.abspath(cfg.out)}", flush=True)
    return out


def update_run(cfg, model, optims: dict, dtype: torch.dtype = torch.float32, **fields):
    """What train.advantages and train.update read of a run (trainer/run.py's `Run`), for
    calling them on a model directly (the tests, bench/replay_step.py,
    bench/rollout_overhead.py): the model computing in `dtype` (distributed.Precision)
    on the CPU; `fields` (ref, critic, pad, compute_dtype, ...) add to these or replace
    them."""
    return SimpleNamespace(**{
        "cfg": cfg, "model": model, "prec": Precision(model, dtype), "compute_dtype": dtype,
        "optims": optims, "ref": None, "critic": None, "pad": 0,
        "device": torch.device("cpu"),
        "engine_kind": cfg.engine, "lr_scale": 1.0,
        "update_gen": torch.Generator().manual_seed(cfg.seed), **fields})
