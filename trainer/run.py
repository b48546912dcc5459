"""The layer a training step walks through, each piece called from train.py at one named point:
the loop over steps (`Run.steps`: held-out evaluations, checkpoints, the env-error rules,
signals; `Run.begin`: the progress bar, the first evaluation), the tasks a step plays, the
engine made ready to sample, the rollout's metrics (`outcomes`, also eval.py's) and log
(`write_log`), the update's critical section and statistics (`UpdateStats`), the metrics
line. Nothing here changes what a step computes: which trajectories are trained on, the
advantages, the loss, the learning rate and the weight sync are written in train.py; the
update's rows in passes are distributed.py's.

Setting the run up (models, engine, env server, --resume) and ending it (the summary, a stop,
a crash) is trainer/setup.py. Under torchrun every rank brings its own whole groups; FSDP's
forward and backward are collectives, so every rank runs as many passes as the busiest one,
the extra ones on a blank row without sampled tokens (weight 0); a rank may bring no
trajectory at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import signal
import sys
import time

import torch
from tqdm import tqdm

import algos
from distributed import (Precision, all_gather_list, all_max, all_sum, gathered, global_rank,
                         rank_items, world_size)
from engines import HFEngine
from env_server.agents import has_chance, opens_by_guessing
from env_client import EnvError, EnvPool, Transport
from models.policy import dtype_name
from rollout import (ChatFormat, RandomPolicy, RolloutConfig, Trajectory, informative_groups,
                     is_success)
from scheduler import horizons
from trainer.checkpoints import resume_command, save_checkpoint
from trainer.config import Config
from trainer.held_out import CHANCE_SAMPLES, categories_for, held_out


# ============================================================ the named points of train.py
@contextlib.contextmanager
def generating(run):
    """The engine ready to sample: vLLM awake (weights, KV cache on the GPU), then asleep,
    leaving the memory to the update; under torchrun HF samples from gathered weights (each
    rank generates alone: distributed.gathered)."""
    run.engine.wake_up()
    try:
        sharded = world_size() > 1 and isinstance(run.engine, HFEngine)  # under FSDP
        with gathered(run.prec.model) if sharded else contextlib.nullcontext():
            yield
    finally:
        run.engine.sleep()


def log_rollout(run, step: int, K: int, played: list[Trajectory], m: dict, seconds: float):
    """The rollout's time and speed into the step's metrics `m`, the first env error's text,
    and every trajectory played (dynamic sampling's extra rounds too) into OUT/rollouts/."""
    m.update(time_rollout_s=seconds,
             tokens_per_s=sum(sum(t.loss_mask) for t in played) / max(seconds, 1e-9))
    if global_rank() == 0:
        write_log(f"{run.cfg.out}/rollouts/step_{step:06d}.jsonl", step, K, played)
    m["first_error"] = next((t.error for t in played if t.status == "env_error"), None)


def rollout_metrics(trajs: list[Trajectory], K: int) -> dict:
    """The step's `outcomes` (statuses as status_*), template checks; speed: log_rollout."""
    o, kept = outcomes(trajs), [t for t in trajs if t.status != "env_error"]
    groups = {t.group for t in kept}
    means = {k: o[k] for k in ("reward_mean", "success_rate", "turns_mean")}
    return {"max_turns": K, **means, **{f"status_{k}": v for k, v in o["statuses"].items()},
            "guess_share": o["guess_share"],
            "template_mismatch": sum(t.template == "mismatch" for t in trajs),
            "groups_informative": len(informative_groups(kept)) / max(1, len(groups))}


def outcomes(trajs: list[Trajectory]) -> dict:
    """How episodes ended, counted in this one place (training, eval.py): statuses over all,
    the rest over those without env errors; turns_per_success None where none succeeded."""
    kept = [t for t in trajs if t.status != "env_error"]
    wins = [t.turns for t in kept if is_success(t)]
    n = max(1, len(kept))
    return {"episodes": len(kept), "env_errors": len(trajs) - len(kept),
            "success_rate": len(wins) / n, "reward_mean": sum(t.reward for t in kept) / n,
            "turns_mean": sum(t.turns for t in kept) / n,
            "turns_per_success": sum(wins) / len(wins) if wins else None,
            "guess_share": sum(opens_by_guessing(t.messages) for t in kept) / n,
            "statuses": {s: sum(t.status == s for t in trajs)
                         for s in ("done", "max_turns", "context_limit", "env_error")}}


def write_log(path: str, step: int, max_turns: int, trajs: list[Trajectory]) -> None:
    """OUT/rollouts/step_000042.jsonl: a JSON line per trajectory, its fields, `step`,
    `max_turns` (the format the viewer and sft.py --from-log read)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for t in trajs:
            d = dataclasses.asdict(t)
            d.update(step=step, max_turns=max_turns)
            f.write(json.dumps(d) + "\n")
    os.replace(tmp, path)


@dataclasses.dataclass
class Run:
    """What a step needs, made once by `setup`: models, optimizers, engine, schedule, data."""
    cfg: Config
    url: str
    server: object  # the local env server (env_server.app.ServerProcess); --env-addr: None
    device: torch.device
    tokenizer: object
    fmt: ChatFormat
    pad: int
    model: torch.nn.Module  # the fp32 master weights: the optimizer's and the checkpoint's
    prec: Precision  # prec.model computes (sampling, forward, backward): master or bf16 copy
    compute_dtype: torch.dtype  # prec's; under torchrun FSDP's mixed precision's (prec: fp32)
    ref: torch.nn.Module | None  # the KL reference (the initial policy), with --kl-coef
    critic: torch.nn.Module | None  # with an estimator that needs one (PPO)
    optims: dict
    engine: object
    schedule: object
    data_rng: random.Random  # the same on every rank: all ranks draw the same tasks
    sample_gen: torch.Generator  # this rank's sampling stream
    update_gen: torch.Generator  # the update's shuffle (vLLM's CPU sampler: the global RNG)
    pool: EnvPool
    train_ids: list[int]
    test_ids: list[int]
    categories: dict
    threads: int  # torch threads during rollouts (the env server needs a core)
    update_threads: int  # and during the update, which makes no env call
    start: int = 1  # the first step to play (after a checkpoint's)
    evals: list = dataclasses.field(default_factory=list)  # the held-out evaluations so far
    safe: tuple = (0, None)  # (step, its snapshot): what a stop saves, weights as they are
    saved: int = 0  # the step of the checkpoint on disk
    lr_scale: float = 1.0  # halved by the --max-update-kl guard
    reporter: object = None  # report.Reporter (rank 0; --report-to)
    figures: str = ""  # the last step's K, reward and success, on the progress bar
    engine_kind: str = "hf"  # the engine that runs (--engine auto resolved): hf or vllm
    intr: object = None  # Interrupts (below), while the loop runs
    bar: object = None  # the progress bar (on every rank; shown on rank 0's)
    last: dict = dataclasses.field(default_factory=dict)  # the last step's metrics
    summary: dict = dataclasses.field(default_factory=dict)  # finish()'s, at the end
    t_start: float = 0.0
    minutes_before: float = 0.0  # the run's minutes up to its checkpoint (--resume)
    bad_steps: int = 0  # steps in a row not trained on for env errors
    chance: dict | None = None  # a random policy's held-out success (the first evaluation's)
    before_update: tuple = ((0, None), [])  # (safe, optimizer_steps) as the update began

    # ---------------------------------------------------------------- train.py's named points
    def steps(self):
        """The steps from `start` to --steps (`begin`: the bar, the first evaluation); between
        steps: the env-error rules, evaluations, checkpoints, and (under torchrun) the ranks
        agreeing to stop on a signal."""
        cfg = self.cfg
        for step in self.begin():
            # a stop in this step's rollout replays the step on resume
            self.safe = (step - 1, snapshot(self))
            restart_if_dead(self.server)
            if self.bad_steps and cfg.env_wait > 0:  # the last step lost to env errors
                wait_for_env(self.server, self.url, cfg.env_wait)
            yield step  # train.py plays and updates; run.log sets self.last and self.safe
            last = self.last
            self.figures = (f"K={last['max_turns']}, reward={last['reward_mean']:.2f}, "
                            f"success={last['success_rate']:.2f}")
            self.show("")
            if self.bad_steps:  # this step lost to env errors (log counts them)
                too_many_env_errors(self, step, last, self.bad_steps, self.intr)
            if eval_due(cfg, step):
                evaluate(self, step)
            if cfg.save_every >= 0 and (step == cfg.steps
                                        or (cfg.save_every and step % cfg.save_every == 0)):
                with self.intr.critical():
                    save(self, *self.safe)
            stopping = self.intr.signum is not None
            if world_size() > 1 and all_max(int(stopping)):  # the ranks stop together
                raise KeyboardInterrupt

    def begin(self) -> tqdm:
        """The run's start: its clock, what a stop before the first update saves, the bar over
        the steps to play (shown on rank 0), the starting policy's evaluation (or one a stop
        cut short)."""
        cfg = self.cfg
        self.t_start = time.time()
        self.safe, self.saved = (self.start - 1, snapshot(self)), self.start - 1
        self.bar = tqdm(range(self.start, cfg.steps + 1), desc=f"{cfg.env} {cfg.algo}",
                        initial=self.start - 1, total=cfg.steps, dynamic_ncols=True,
                        disable=global_rank() != 0)
        prev = self.start - 1
        if prev == 0 or (eval_due(cfg, prev) and prev not in [e["step"] for e in self.evals]):
            evaluate(self, prev)
        return self.bar

    def show(self, text: str) -> None:
        """What the step is doing now, on the progress bar after the last step's figures."""
        if self.bar is not None:  # (a disabled bar, on other ranks, shows nothing)
            self.bar.set_postfix_str(", ".join(x for x in (self.figures, text) if x))

    def tasks_for_step(self) -> tuple[list[int], list[int]]:
        """--batch-size training tasks drawn for the step (the same on every rank), each
        --group-size times: this rank's share of them as (item ids, group ids)."""
        cfg = self.cfg
        n = min(cfg.batch_size, len(self.train_ids))
        chosen = self.data_rng.sample(self.train_ids, n)
        return rank_items(chosen, cfg.batch_size, cfg.group_size, global_rank(), world_size())

    def progress(self, K: int):
        """The rollout's progress callback: the turn, how many episodes ended, on the bar."""
        extra = [f"resample {r}" for r in range(1, self.cfg.max_resample + 1)]
        rounds = iter(["rollout"] + extra)
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
        with self.intr.critical():  # crashed() saves the step before if no weight moves
            self.before_update = (self.safe, optimizer_steps(self.optims))
            self.safe = (self.safe[0], None)
            try:
                yield
            finally:
                torch.set_num_threads(self.threads)

    def log(self, step: int, m: dict) -> None:
        """The step's metrics line (metrics.jsonl, reporters); the state a stop now saves is
        this step's (its weights are the engine's)."""
        m["skipped_update"] = int("loss" not in m)
        if self.device.type == "cuda":
            m["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        m["step"] = step
        self.bad_steps = self.bad_steps + 1 if m.pop("bad", False) else 0  # in a row
        row = {k: v for k, v in m.items() if k != "first_error"}
        if global_rank() == 0:
            with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.cfg.report_to != "none":  # TensorBoard, W&B
                self.reporter.log("train", row, step)
        # a signal the critical section held back stops the run after it: with this step saved
        self.safe = (step, snapshot(self))
        self.last = m


def optimizer_steps(optims: dict) -> list[float]:
    """Adam's step count of each parameter: it changes exactly when a weight may have moved."""
    return [float(st.get("step", 0)) for o in optims.values() for st in o.state.values()]


def restart_if_dead(server) -> None:
    """The local env server (an env_server.app.ServerProcess; None with --env-addr) restarted
    if it died; the pool replaces the lost instances at its next reset."""
    if server is not None and server.proc.poll() is not None:  # it exited
        tqdm.write(f"the env server died (exit code {server.proc.returncode}); restarting it "
                   f"on {server.url}")
        try:
            server.restart()
        except RuntimeError as e:
            tqdm.write(f"could not restart the env server: {e}")


def wait_for_env(server, url: str, wait_s: float) -> None:
    """After a step lost to env errors: wait up to `wait_s` for the server to answer (a
    restart elsewhere takes a while), restarting the local one if it dies meanwhile."""
    deadline = time.time() + wait_s
    while True:
        try:
            Transport(url, timeout=5.0, retries=0).request("GET", "/")
            return
        except EnvError as e:
            if e.kind not in ("connection", "timeout"):
                return  # it answered (AgentGym servers answer the health check in plain text)
            if time.time() > deadline:
                tqdm.write(f"the env server at {url} has not answered for {wait_s:g} s: {e}")
                return
        time.sleep(1.0)
        restart_if_dead(server)


def eval_due(cfg: Config, step: int) -> bool:
    return step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)


def evaluate(run: Run, step: int) -> None:
    """Held-out evaluation (trainer/held_out.py): every rank plays its share of the test tasks;
    rank 0 writes. Chance beside it: the random policy's, once a run (it does not learn)."""
    cfg = run.cfg
    if not (cfg.eval_every and run.test_ids):
        return
    rcfg = RolloutConfig.of(cfg, cfg.eval_turns or max(horizons(cfg.schedule)))
    # the same each time
    gen = torch.Generator(run.sample_gen.device).manual_seed(cfg.seed + 12345 + global_rank())
    played = functools.partial(held_out, url=run.url, env=cfg.env, test_ids=run.test_ids,
                               rcfg=rcfg, step=step, batch=cfg.eval_batch,
                               timeout=cfg.env_timeout, agent=cfg.agent)
    t0 = time.time()
    with generating(run):
        trajs = played(run.engine, run.fmt, generator=gen, samples=cfg.eval_samples)
    r = eval_result(run, trajs, step, rcfg, cfg.eval_samples, time.time() - t0)
    if run.chance is None and has_chance(cfg.env):
        samples = max(cfg.eval_samples, CHANCE_SAMPLES)
        c = eval_result(run, played(None, None, generator=None, samples=samples,
                                    policy=RandomPolicy(cfg.env, cfg.seed)), step, rcfg,
                        samples, 0.0)
        run.chance = {"chance": c["success_rate"], "chance_by_category": c["by_category"],
                      "chance_samples": c["samples"]}
    if run.chance is not None:  # a random policy's on the same tasks and K
        r.update(run.chance)
    run.evals.append(r)
    if global_rank() == 0:
        with open(os.path.join(cfg.out, "eval.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        run.reporter.log("eval", r, step)
        beside = f", chance {r['chance']:.3f}" if "chance" in r else ""
        tqdm.write(f"held-out eval after step {step}: success {r['success_rate']:.3f} on "
                   f"{r['tasks']} test tasks x {r['samples']} (K={rcfg.max_turns}, "
                   f"{r['time_s']:.0f}s{beside})")


def eval_result(run: Run, trajs: list[Trajectory], step: int, rcfg: RolloutConfig,
                samples: int, seconds: float) -> dict:
    """The held-out episodes' `outcomes`, overall and by category, env errors left out and
    counted: a line of eval.jsonl."""
    kept, o = [t for t in trajs if t.status != "env_error"], outcomes(trajs)
    cat = categories_for(run.cfg.env, run.test_ids, run.categories)
    by_category = {c: outcomes([t for t in kept if cat[t.item_id] == c])["success_rate"]
                   for c in sorted({cat[t.item_id] for t in kept})}
    reported = ("episodes", "env_errors", "success_rate", "reward_mean", "turns_mean",
                "guess_share")
    return {"step": step, "max_turns": rcfg.max_turns, "tasks": len({t.item_id for t in kept}),
            "samples": samples, **{k: o[k] for k in reported}, "by_category": by_category,
            "time_s": seconds}


def snapshot(run: Run) -> dict:
    """What a run resumed after the last update needs besides weights and optimizer: the
    schedule, the guard's scale, the env-error steps in a row, this rank's random streams
    (data order, sampling, update shuffle, torch)."""
    rng = {"sample_gen": run.sample_gen.get_state(), "update_gen": run.update_gen.get_state(),
           "torch_rng": torch.get_rng_state()}
    return {"schedule": run.schedule.state_dict(), "data_rng": run.data_rng.getstate(),
            "lr_scale": run.lr_scale, "bad_steps": run.bad_steps, "rng": rng}


def save(run: Run, step: int, snap: dict) -> None:
    state = {"step": step, "schedule": snap["schedule"], "data_rng": snap["data_rng"],
             "lr_scale": snap["lr_scale"], "bad_steps": snap["bad_steps"],
             "rank_rngs": all_gather_list([snap["rng"]]),
             "device_type": run.sample_gen.device.type,
             "dtype": dtype_name(run.compute_dtype),
             "config": dataclasses.asdict(run.cfg), "minutes": minutes(run)}
    save_checkpoint(run.cfg.out, run.model, run.tokenizer, run.critic, run.optims, state)
    run.saved = step


def minutes(run: Run) -> float:
    """The run's minutes so far: every session's, from the start of its first step."""
    return run.minutes_before + (time.time() - run.t_start) / 60


def too_many_env_errors(run: Run, step: int, m: dict, bad_steps: int,
                        intr: Interrupts) -> None:
    """A step that was not trained on for env errors; after --env-error-patience of them in a
    row, stop with a checkpoint."""
    cfg = run.cfg
    tqdm.write(f"step {step}: {m['status_env_error']} trajectories hit env errors, above "
               f"--max-env-error-share {cfg.max_env_error_share:g}: not trained on. First: "
               f"{m['first_error']}")
    if bad_steps >= cfg.env_error_patience:
        with intr.critical():
            save(run, *run.safe)
        sys.exit(f"stopping: {bad_steps} steps in a row had more than "
                 f"{cfg.max_env_error_share:.0%} env-error trajectories "
                 f"(--max-env-error-share, --env-error-patience). Last error: "
                 f"{m['first_error']}\nThe checkpoint at step {step} is in {cfg.out}; fix "
                 f"the env server and continue with: {resume_command(cfg.out)}")


# ================================================================ signals
class StopNow(BaseException):
    """A second Ctrl-C / SIGTERM: stop at once, without a checkpoint."""


class Interrupts:
    """Ctrl-C and SIGTERM while training stop the run where --resume continues it exactly.

    Outside `critical()` (rollouts, evaluations) the signal stops the step at once: the
    weights have not changed since the last update, and a resumed run replays the step from
    the random states taken at its start. Inside (the update, a checkpoint write) it waits for
    the section's end, so that nothing is saved half updated. Under torchrun every signal
    waits for the end of the step, where the ranks agree to stop together (a rank leaving in
    the middle of a collective would hang the others). A second signal stops at once, without
    a checkpoint; an interrupted write never replaces the last good one.
    """

    def __init__(self, defer_all: bool):
        self.defer_all, self.signum, self.depth = defer_all, None, 0

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._on_signal)
                         for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame):
        if self.signum is not None:
            name = signal.Signals(signum).name
            raise StopNow(f"{name} again: stopped without a checkpoint")
        self.signum = signum
        if self.depth == 0 and not self.defer_all:
            raise KeyboardInterrupt
        if global_rank() == 0:
            tqdm.write(f"{signal.Signals(signum).name}: stopping after this "
                       f"{'step' if self.defer_all else 'update'} with a checkpoint (send it "
                       "again to stop at once, without one)")

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.signum is not None and not self.defer_all:
            raise KeyboardInterrupt


# ================================================================ the update's statistics
class UpdateStats:
    """Sums over this rank, added over ranks at the end: losses weighted by their share of the
    global loss (so their total is that loss), clip statistics and sampler/trainer mismatch
    per sampled token; the first mini-batch's log-probs before any update, for update_kl."""

    KEYS = ("loss", "entropy", "kl", "value_loss", "clip_frac", "approx_kl", "sampled",
            "logprob_diff", "logprob_kl", "mismatch_tokens", "padded", "real", "share")

    def __init__(self):
        self.acc = dict.fromkeys(self.KEYS, 0.0)
        self.grad_norms, self.before, self.first = [], [], False

    def add(self, rows, idx, share, terms: dict, clip: dict, lp, mask, sampler_lp):
        """A micro-batch (rows `idx`): its loss `terms` (None: not in the loss) by its `share`
        of the global loss, the clip statistics, its log-probs `lp` against the sampler's."""
        acc = self.acc
        for k, value in terms.items():
            if value is not None:
                acc[k] += share * float(value.detach())
        acc["share"] += share
        if self.first:
            self.before.append((idx, lp))
        if idx == [rows.B]:  # a blank pass: nothing to count
            return
        acc["padded"] += len(idx) * (mask.shape[1] + 1)
        acc["real"] += int(rows.batch["attention_mask"][idx].sum())
        sampled = float(mask.sum())  # the clip statistics are means over its sampled tokens
        acc["sampled"] += sampled
        acc["clip_frac"] += clip["clip_frac"] * sampled
        acc["approx_kl"] += clip["approx_kl"] * sampled
        if self.first:  # before any update: the trainer's log-probs against the sampler's
            lp_s, lp_t = sampler_lp[mask > 0], lp[mask > 0]  # the sampler's, the trainer's
            acc["logprob_diff"] += float((lp_t - lp_s).abs().sum())
            acc["logprob_kl"] += float(algos.kl_penalty(lp_s, lp_t, "k3", None).sum())
            acc["mismatch_tokens"] += sampled

    def metrics(self, run, n_steps: int, idle: int) -> dict:
        """The update's metrics; a mean over nothing measured (rows all idle): None, not 0."""
        tot = dict(zip(self.acc, all_sum(list(self.acc.values()))))
        terms = {"loss": run.model, "kl": run.ref, "value_loss": run.critic}  # with a model
        out = {k: tot[k] / n_steps for k, model in terms.items() if model is not None}
        # means over what was measured: the forwarded rows' entropy, the clip statistics and
        # KL(sampler || trainer) (k3 of log(pi_trainer / pi_sampler)) per sampled token
        per = {"entropy": "share", "clip_frac": "sampled", "approx_kl": "sampled",
               "logprob_diff": "mismatch_tokens", "logprob_kl": "mismatch_tokens"}
        out.update({k: tot[k] / tot[n] if tot[n] else None for k, n in per.items()})
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        out["padding_share"] = 1 - tot["real"] / tot["padded"] if tot["padded"] else None
        out["train_tokens"] = int(tot["real"])
        out["idle_rows"] = all_sum([float(idle)])[0]
        return out


