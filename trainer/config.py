"""train.py's flags: every field of `Config` is one `--flag` (cli.arg: its default and help).
train.py's parse_args reads them over --config FILE or a run's own config.json, checks them,
and fills the defaults that depend on the model (None here): the tiny model's (TINY_MODEL), or
with --model those of the settings file configs/real-model.json."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import algos
from env_server.agents import SCHEMES, make_agent
from scheduler import SCHEDULES, horizons, make_schedule, stage_steps
from trainer.checkpoints import (ended_at, find_checkpoint, folder_holder, load_data,
                                 weights_problem)
from trainer.cli import (Shared, arg, check_device, check_env, check_model, check_positive,
                         check_ranges, check_reporter, check_writable, parse_config)
from trainer.report import REPORTERS
import trainer.plateau  # noqa: F401,E402  registers --schedule-kind plateau

TRAIN_DOC = "train.py: multi-turn RL for LLM agents (python train.py -h)"
# The defaults that differ between the built-in tiny model and a real one (--model): a
# settings file for the real model, which -h names, and the tiny model's values here.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_MODEL = os.path.join(ROOT, "configs", "real-model.json")
TINY_MODEL = {"lr": 3e-4, "kl_coef": 0.0, "warmup_steps": 0, "max_update_kl": 0.0,
              "dynamic_sampling": False, "micro_batch_tokens": 16384}


@dataclass
class Config(Shared):
    # Environment
    tasks_file: str | None = arg(
        None, "JSON task ids: {\"train\": [...], \"test\": [...]} or a list (the training "
              "tasks); ids as ints, \"<env>_<n>\" or {\"item_id\": ...} (original release)",
        group='environment')
    # Horizon schedule (ScalingInter-RL)
    schedule: str = arg(
        "10,20,30", "turn horizons: '15' fixed, '10,20,30' grows stage by stage")
    schedule_every: int | None = arg(
        None, "steps per stage (default: steps / number of stages)", group='horizon schedule')
    schedule_kind: str = arg(
        "step", "step: fixed stage length; plateau: advance when success stalls",
        # scheduler.SCHEDULES
        choices=lambda: sorted(SCHEDULES), group='horizon schedule')
    # Algorithm
    algo: str = arg(
        "grpo", "advantage estimator (algos.ESTIMATORS); ppo trains a critic, dr_grpo is "
                "GRPO without the std division",
        choices=lambda: sorted(algos.ESTIMATORS))
    steps: int = arg(15, "training steps")
    batch_size: int = arg(8, "tasks per step (the paper: 16-32 on 8 GPUs)")
    group_size: int = arg(8, "trajectories per task (GRPO/RLOO groups)")
    lr: float | None = arg(
        None, "policy learning rate (AdamW); default: 3e-4 for the built-in tiny model; with "
              "--model configs/real-model.json's (1e-6, the paper's)")
    critic_lr: float = arg(1e-4, "critic learning rate (PPO)", group='algorithm')
    lr_decay: str = arg(
        "none", "learning rates over the steps: none (constant), linear or cosine from --lr "
                "at step 1 (times --warmup-steps' ramp) down to --lr/steps at the last "
                "(lr_at)",
        choices=["none", "linear", "cosine"], group='algorithm')
    weight_decay: float = arg(0.0, "AdamW weight decay", group='algorithm')
    ppo_epochs: int = arg(1, "passes over each batch", group='algorithm')
    mini_batch_size: int | None = arg(
        None, "trajectories per optimizer step (default: the whole batch; with --model a "
              "quarter of it, so that the PPO ratio leaves 1 and clipping binds)",
        group='algorithm')
    warmup_steps: int | None = arg(
        None, "steps over which the learning rate rises linearly to --lr (default: 3 with "
              "--model, 0 for the tiny model)", group='algorithm')
    micro_batch_tokens: int | None = arg(
        None, "padded tokens per forward/backward pass (default: 16384 for the tiny model, "
              "4096 with --model)", group='algorithm')
    clip_low: float = arg(0.2, "PPO ratio clip below 1", group='algorithm')
    clip_high: float = arg(0.2, "PPO ratio clip above 1", group='algorithm')
    dual_clip: float | None = arg(None, "dual-clip constant (> 1) for negative advantages",
                                  group='algorithm')
    value_clip: float = arg(0.2, "critic value clip (PPO)", group='algorithm')
    kl_coef: float | None = arg(
        None, "KL-to-reference loss coefficient (default 0: no reference model; the paper's "
              "is 0.001 with k3, docs/real_model.md says why not here)", group='algorithm')
    kl_kind: str = arg("k3", "KL estimator", choices=["k1", "k2", "k3"], group='algorithm')
    entropy_coef: float = arg(0.0, "entropy bonus coefficient", group='algorithm')
    gamma: float = arg(
        1.0, "discount over sampled tokens (REINFORCE++, PPO) or turns (GiGPO's step level)",
        group='algorithm')
    lam: float = arg(1.0, "GAE lambda (PPO)", group='algorithm')
    step_adv_weight: float = arg(
        1.0, "GiGPO: weight of the step-level advantage added to the episode's (GiGPO's "
             "paper discounts with --gamma 0.95)", group='algorithm')
    max_grad_norm: float = arg(1.0, "gradient clipping", group='algorithm')
    loss_agg: str = arg(
        "seq_mean_token_mean", "loss aggregation", choices=list(algos.AGG_MODES),
        group='algorithm')
    tis_cap: float | None = arg(
        None, "truncated importance sampling: weight each token's policy loss by "
              "min(pi_old / pi_sampler, C), this C (absent: off)", group='algorithm')
    max_update_kl: float | None = arg(
        None, "guard: a step whose update_kl (KL(before || after) per sampled token) passes "
              "this halves the learning rate from the next step on (default: 0.01 with "
              "--model; 0: off)", group='algorithm')
    dynamic_sampling: bool | None = arg(
        None, "replace groups whose trajectories all scored the same by fresh tasks, so that "
              "every update sees informative groups (default: on with --model)",
        group='algorithm')
    max_resample: int = arg(
        2, "dynamic sampling: at most this many extra rollout rounds per step",
        group='algorithm')
    resample: str = arg(
        "fresh", "dynamic sampling: what a tied group's round plays: fresh (new tasks in its "
                 "place, DAPO) or extend (its own task again, --group-size more samples "
                 "merged into the group: more signal from tasks the policy rarely solves)",
        choices=["fresh", "extend"], group='algorithm')
    grad_checkpointing: bool = arg(
        False, "recompute activations in the backward (less memory, ~30% slower)",
        group='algorithm')
    # Agent (agents.py)
    agent: str = arg(
        "react", "agent scheme (agents.SCHEMES): react (Thought/Action), plan (plan first, "
                 "then act), reflect (reflect and retry after a failed attempt)",
        choices=lambda: sorted(SCHEMES), group='agent')
    # Generation
    vllm_gpu_memory: float = arg(
        0.5, "vLLM: share of the GPU memory for weights and KV cache", group='generation')
    vllm_kv_tokens: int = arg(
        0, "vLLM on a CPU: tokens of KV cache (0: a step's episodes x --max-context, at most "
           "a quarter of RAM); lower it to run two jobs side by side on one machine",
        group='generation')
    top_p: float = arg(1.0, "nucleus sampling", group='generation')
    max_context: int = arg(4096, "tokens per trajectory", group='generation')
    # Held-out evaluation (the env's test split, sampled at --temperature as in the paper)
    eval_every: int = arg(
        15, "held-out evaluation every N steps, and before the first and after the last (0: "
            "never)", group='held-out evaluation')
    eval_tasks: int = arg(52, "test tasks per evaluation, spread over the split (0: all)",
                          group='held-out evaluation')
    eval_batch: int = arg(
        64, "held-out episodes played at once: env instances, beside training's (SciWorld: "
            "JVMs)", group='held-out evaluation')
    eval_turns: int | None = arg(None, "horizon of the evaluation episodes (default: the "
                                       "schedule's largest)", group='held-out evaluation')
    eval_samples: int = arg(
        1, "episodes per test task in each evaluation (success: the mean over all of them)",
        group='held-out evaluation')
    # Run
    out: str | None = arg(None, "run folder (default runs/{env}__{algo}__{seed}__{time})")
    resume: bool = arg(False, "continue the run in --out from its checkpoint")
    save_every: int = arg(
        5, "checkpoint every N steps and at the end (0: only at the end; -1: never, but on "
           "Ctrl-C, SIGTERM or an exception); the tiny model's costs 0.1 s", group='run')
    report_to: str = arg(
        "none", "also log metrics, evaluations and the config to TensorBoard "
                "(OUT/tensorboard) or W&B (WANDB_MODE=offline works)",
        choices=list(REPORTERS), group='run')
    device: str = arg("auto", "cpu, cuda or auto", group='run')
    # Faults (docs/reliability.md)
    env_timeout: float = arg(
        120.0, "seconds an env server may take for one call; past it: an env error",
        group='faults')
    max_env_error_share: float = arg(
        0.5, "a step with a larger share of env-error trajectories is not trained on",
        group='faults')
    env_error_patience: int = arg(
        3, "stop, with a checkpoint, after this many such steps in a row", group='faults')
    env_wait: float = arg(
        120.0, "after such a step, seconds to wait for the env server (a local one is "
               "restarted)", group='faults')


# an --out holding one holds a run; a config.json alone does not
RUN_FILES = ("metrics.jsonl", "eval.jsonl", "checkpoint")


def parse_args(argv=None, description: str = TRAIN_DOC) -> Config:
    """The config: the flags, over --config FILE or (with --resume) the run's own config.json;
    every check here, before anything is written, so that a corrected command can follow a
    refused one."""
    p, cfg = parse_config(Config, argv, description, prog="train.py")
    at_least_1 = ("steps", "batch_size", "group_size", "ppo_epochs", "max_new_tokens",
                  "micro_batch_tokens", "eval_batch", "eval_samples")
    check_positive(p, cfg, at_least_1)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    per_rank = (("batch-size", cfg.batch_size), ("mini-batch-size", cfg.mini_batch_size))
    for name, value in per_rank:
        if value is not None and value % world:
            p.error(f"--{name} {value} must be divisible by the number of processes "
                    f"({world}): each rank plays whole groups")
    check_ranges(p, cfg, {
        "lr": "(0, inf)", "critic_lr": "(0, inf)", "temperature": "(0, inf)",
        "top_p": "(0, 1]", "gamma": "[0, 1]", "lam": "[0, 1]", "weight_decay": "[0, inf)",
        "clip_low": "[0, 1)", "clip_high": "[0, inf)", "tis_cap": "(0, inf)",
        "kl_coef": "[0, inf)", "entropy_coef": "[0, inf)", "step_adv_weight": "[0, inf)",
        "value_clip": "(0, inf)", "max_grad_norm": "(0, inf)",
        "vllm_gpu_memory": "(0, 1]", "vllm_kv_tokens": "[0, inf)",
        "mini_batch_size": "[1, inf)", "dual_clip": "(1, inf)", "eval_every": "[0, inf)",
        "eval_tasks": "[0, inf)", "eval_turns": "[1, inf)", "schedule_every": "[1, inf)",
        "env_timeout": "(0, inf)", "env_wait": "[0, inf)", "max_env_error_share": "[0, 1)",
        "env_error_patience": "[1, inf)"})
    if cfg.out and (holder := folder_holder(cfg.out)):  # a live run's: a second writer
        p.error(f"--out {cfg.out} is in use by {holder}: wait for it to end, or give another "
                "folder")
    checks = [(cfg.max_context > cfg.max_new_tokens,
               "--max-context must be larger than --max-new-tokens"),
              (not cfg.resume or cfg.out, "--resume needs --out: the run folder to continue"),
              (not cfg.resume or not cfg.out or find_checkpoint(cfg.out),
               f"--resume: no checkpoint in {cfg.out}"),
              (cfg.save_every >= -1,
               "--save-every must be -1 (never), 0 (at the end) or a number of steps"),
              (cfg.warmup_steps is None or cfg.warmup_steps >= 0,
               "--warmup-steps must be 0 or more"),
              (cfg.max_update_kl is None or cfg.max_update_kl >= 0,
               "--max-update-kl must be 0 (off) or more"),
              (cfg.max_resample >= 0, "--max-resample must be 0 or more"),
              (cfg.schedule_every is None or cfg.schedule_kind != "plateau",
               "--schedule-every is the step schedule's stage length; --schedule-kind "
               "plateau moves on when success stops improving, not after a number of steps"),
              (not (cfg.dynamic_sampling and world > 1 and "dynamic_sampling" in p.given),
               "--dynamic-sampling runs in one process only (not under torchrun)")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    if not -2 ** 63 <= cfg.seed < 2 ** 63:  # torch's generators take 64 bits; ranks add to it
        p.error(f"--seed {cfg.seed}: a seed must fit in 64 bits (-2**63 to 2**63 - 1)")
    check_device(p, cfg.device)
    check_env(p, cfg)
    check_reporter(p, cfg.report_to)
    try:
        schedule = make_schedule(cfg.schedule,
                                 stage_steps(cfg.schedule, cfg.steps, cfg.schedule_every),
                                 cfg.schedule_kind)
    except ValueError as e:
        p.error(str(e))
    stages = len(horizons(cfg.schedule))
    if cfg.schedule_kind == "step" and schedule.stage(cfg.steps) < stages - 1:
        reached = schedule.stage(cfg.steps) + 1
        warn(f"--steps {cfg.steps} reaches {reached} of the {stages} stages of --schedule "
             f"{cfg.schedule}; the later horizons are never played")
    if cfg.out is not None:
        check_out(p, cfg.out)
    held = [f for f in RUN_FILES if cfg.out and os.path.exists(os.path.join(cfg.out, f))]
    if held and not cfg.resume:
        p.error(f"--out {cfg.out} already holds a run: give another folder, or --resume to "
                "continue that one" if find_checkpoint(cfg.out) else
                f"--out {cfg.out} holds a run stopped before its first checkpoint "
                f"({', '.join(held)}): give another folder, or remove that one")
    check_model(p, cfg.model)  # last: it may load a tokenizer (seconds)
    # the settings file's, or the tiny's
    defaults = REAL_MODEL if cfg.model is not None else TINY_MODEL
    filled = []
    for name, value in (json.load(open(defaults)).items() if isinstance(defaults, str)
                        else defaults.items()):
        if not name.startswith("_") and getattr(cfg, name) is None:
            setattr(cfg, name, value)
            filled.append(name)
    if cfg.mini_batch_size == "quarter":
        quarter = cfg.batch_size * cfg.group_size // 4
        cfg.mini_batch_size = max(world, quarter // world * world)
    if cfg.dynamic_sampling and world > 1 and "dynamic_sampling" not in p.given:
        cfg.dynamic_sampling = False  # a default (or a resumed run's), where it cannot run
    if cfg.dynamic_sampling and not algos.estimator(cfg.algo).grouped:
        if "dynamic_sampling" in p.given:
            p.error(f"--dynamic-sampling with --algo {cfg.algo}: its advantages are not "
                    "relative to the group, so a tied group still carries signal and must "
                    "not be replaced; drop the flag, or use a group-relative --algo ("
                    + ", ".join(n for n, e in sorted(algos.ESTIMATORS.items()) if e.grouped)
                    + ")")
        cfg.dynamic_sampling = False  # the real-model default is for group-relative ones
    if cfg.resample == "extend" and not cfg.dynamic_sampling:
        p.error("--resample extend is a kind of dynamic sampling, which is off: add "
                "--dynamic-sampling")
    check_learnable(p, cfg)
    if cfg.resume:
        check_resume(p, cfg)
    if cfg.model is not None and filled and os.environ.get("RANK", "0") == "0":
        # a model folder made by SFT is a --model too: these are not the tiny model's settings
        settings = os.path.relpath(REAL_MODEL, ROOT)
        print(f"train.py: --model: real-model defaults from {settings}: "
              + ", ".join(flag_text(n, getattr(cfg, n)) for n in filled)
              + " (a flag or --config overrides each)", file=sys.stderr)
    return cfg


def warn(message: str) -> None:
    """A setting that runs but likely not as meant: one line, once (rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: warning: {message}", file=sys.stderr)


def flag_text(name: str, value) -> str:
    """A field as its flag on a command line: `--lr 1e-06`, `--dynamic-sampling`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def check_out(p, out: str) -> None:
    """--out a folder that can be made and written in (cli.check_writable)."""
    check_writable(p, "--out", out, "the run's folder (or leave --out out for runs/...)")


def check_learnable(p, cfg: Config) -> None:
    """Settings under which nothing is ever learned are refused, ones that learn less than
    they seem to are warned of (--max-context is checked against the prompt in setup:
    check_context)."""
    if cfg.group_size == 1 and cfg.algo == "rloo":
        p.error("--group-size 1 with --algo rloo: the baseline is the mean of the rest of "
                "the group, so every advantage is 0 and nothing is learned; give "
                "--group-size 2 or more")
    if cfg.group_size == 1 and cfg.dynamic_sampling:
        p.error("--group-size 1 with --dynamic-sampling: a group of one always ties, so "
                "every group is replaced and none is trained on; give --group-size 2 or "
                "more, or --no-dynamic-sampling")
    if cfg.group_size == 1 and cfg.algo in ("grpo", "dr_grpo", "gigpo"):
        warn(f"--group-size 1 with --algo {cfg.algo}: a group of one has no baseline, so "
             "its advantage is its raw score: a win is reinforced, a failure (score 0) "
             "teaches nothing")
    rounds = horizons(cfg.schedule)
    if cfg.schedule_kind in ("step", "plateau") and rounds != sorted(rounds):
        warn(f"--schedule {cfg.schedule} shrinks the horizon: ScalingInter-RL grows it "
             "stage by stage (10,20,30); the run ends on the shorter horizon")


def check_resume(p, cfg: Config) -> None:
    """--resume against its checkpoint: a damaged one, another --env, --seed or --model is
    refused (the checkpoint holds that model's weights for that game and the random streams of
    that seed); another --batch-size, --group-size or --algo is taken with a warning (the run
    is no longer the one an unbroken run would be); a checkpoint past --steps, or at it where
    the run ended there (its summary.json), leaves nothing to do: one line, exit 0, nothing
    written."""
    ckpt = find_checkpoint(cfg.out)
    try:
        st = load_data(os.path.join(ckpt, "trainer_state.pt"))
    except ValueError as e:  # a pickle that would run code, or a damaged file
        p.error(f"--resume: {e}")
    if not isinstance(st, dict) or "step" not in st:
        p.error(f"--resume: {ckpt}/trainer_state.pt is not a trainer state")
    if problem := weights_problem(os.path.join(ckpt, "model")):
        p.error(f"--resume: {problem}")
    saved = st.get("config", {})
    for name in ("env", "seed", "model"):
        if name in saved and getattr(cfg, name) != saved[name]:
            was = "the tiny model" if saved[name] is None else flag_text(name, saved[name])
            p.error(f"--resume: {cfg.out} is a run of {was}, not {getattr(cfg, name)}: "
                    "resume it with its own, or start another --out")
    changed = [n for n in ("batch_size", "group_size", "algo")
               if n in saved and getattr(cfg, n) != saved[n]]
    if changed:
        warn(f"--resume: from step {st['step'] + 1} " + ", ".join(
            f"{flag_text(n, getattr(cfg, n))} (the run's: {saved[n]})" for n in changed) +
            ": the run is no longer the one an unbroken run would be")
    # at --steps with no summary: stopped in its last step, its final evaluation still to do
    if st["step"] > cfg.steps or (st["step"] == cfg.steps and ended_at(cfg.out, st["step"])):
        print(f"train.py: --resume: the checkpoint in {cfg.out} is at step {st['step']} and "
              f"--steps is {cfg.steps}: nothing to do (a larger --steps extends the run)")
        sys.exit(0)


def check_context(cfg: Config, fmt) -> None:
    """--max-context against the opening prompt in this tokenizer (the instructions in the
    chat template, before any observation): where no reply fits after it, every trajectory
    ends at the context limit without a sampled token, and nothing is learned; refused before
    anything is written."""
    n = len(fmt.prompt_ids(make_agent(cfg.agent, cfg.env, 1).opening("")))
    need = n + cfg.max_new_tokens
    if need > cfg.max_context:
        sys.exit(f"--max-context {cfg.max_context}: the opening prompt alone is {n} tokens "
                 f"({cfg.env}'s instructions in this model's chat template, before the first "
                 f"observation) and a reply takes --max-new-tokens {cfg.max_new_tokens}: no "
                 f"trajectory would reach its first reply; give well over {need}")
