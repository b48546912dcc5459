"""train.py's flags: every field of `Config` is one `--flag` (cli.arg: its default and help). train.py's
parse_args reads them over --config FILE or a run's own config.json, checks them, and fills the defaults
that depend on the model (None here: "default ... with --model")."""

from __future__ import annotations

import os
from dataclasses import dataclass

import algos
from agents import SCHEMES
from cli import arg
from report import REPORTERS
from scheduler import SCHEDULES


@dataclass
class Config:
    # Environment
    env: str = arg("textcraft", "environment (agents.ENVS): textcraft, babyai, sciworld, searchqa, webarena, corridor")
    env_addr: str | None = arg(None, "URL of a running env server; absent: start one locally")
    tasks_file: str | None = arg(None, "JSON task ids: {\"train\": [...], \"test\": [...]} or a list (the training "
                                       "tasks); ids as ints, \"<env>_<n>\" or {\"item_id\": ...} (original release)")
    # Horizon schedule (ScalingInter-RL)
    schedule: str = arg("10,20,30", "turn horizons: '15' fixed, '10,20,30' grows stage by stage")
    schedule_every: int | None = arg(None, "steps per stage (default: steps / number of stages)")
    schedule_kind: str = arg("step", "step: fixed stage length; plateau: advance when success stalls",
                             choices=lambda: sorted(SCHEDULES))  # scheduler.SCHEDULES
    # Algorithm
    algo: str = arg("grpo", "advantage estimator (algos.ESTIMATORS); ppo trains a critic, dr_grpo is GRPO without the "
                            "std division", choices=lambda: sorted(algos.ESTIMATORS))
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
    mini_batch_size: int | None = arg(None, "trajectories per optimizer step (default: the whole batch; with --model a "
                                            "quarter of it, so that the PPO ratio leaves 1 and clipping binds)")
    warmup_steps: int | None = arg(None, "steps over which the learning rate rises linearly to --lr (default: 3 with "
                                         "--model, 0 for the tiny model)")
    micro_batch_tokens: int = arg(16384, "padded tokens per forward/backward pass")
    clip_low: float = arg(0.2, "PPO ratio clip below 1")
    clip_high: float = arg(0.2, "PPO ratio clip above 1")
    dual_clip: float | None = arg(None, "dual-clip constant (> 1) for negative advantages")
    value_clip: float = arg(0.2, "critic value clip (PPO)")
    kl_coef: float | None = arg(None, "KL-to-reference loss coefficient (default: 0.001 with --model, the paper's k3 "
                                      "setting; 0 for the tiny model; 0: no reference model)")
    kl_kind: str = arg("k3", "KL estimator", choices=["k1", "k2", "k3"])
    entropy_coef: float = arg(0.0, "entropy bonus coefficient")
    gamma: float = arg(1.0, "discount over sampled tokens (REINFORCE++, PPO)")
    lam: float = arg(1.0, "GAE lambda (PPO)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    loss_agg: str = arg("seq_mean_token_mean", "loss aggregation", choices=list(algos.AGG_MODES))
    tis_cap: float | None = arg(None, "truncated importance sampling: weight each token's policy loss by "
                                      "min(pi_old / pi_sampler, C), this C (absent: off)")
    max_update_kl: float | None = arg(None, "guard: a step whose update_kl (KL(before || after) per sampled token) "
                                            "passes this halves the learning rate from the next step on (default: "
                                            "0.01 with --model; 0: off)")
    dynamic_sampling: bool | None = arg(None, "replace groups whose trajectories all scored the same by fresh tasks, so "
                                              "that every update sees informative groups (default: on with --model)")
    max_resample: int = arg(2, "dynamic sampling: at most this many extra rollout rounds per step")
    resample: str = arg("fresh", "dynamic sampling: what a tied group's round plays: fresh (new tasks in its place, "
                                 "DAPO) or extend (its own task again, --group-size more samples merged into the "
                                 "group: more signal from tasks the policy rarely solves)", choices=["fresh", "extend"])
    grad_checkpointing: bool = arg(False, "recompute activations in the backward (less memory, ~30% slower)")
    # Agent (agents.py)
    agent: str = arg("react", "agent scheme (agents.SCHEMES): react (Thought/Action), plan (plan first, then act), "
                              "reflect (reflect and retry after a failed attempt)", choices=lambda: sorted(SCHEMES))
    # Generation
    model: str | None = arg(None, "HF model folder or hub name; absent: the built-in tiny model, warm-started")
    engine: str = arg("auto", "generation engine: HF (anywhere), vLLM (colocated, CPU or GPU, where it is installed; "
                              "one engine per rank), or auto: vLLM for models of 10M parameters or more where it "
                              "imports and one process generates (or on CUDA), else HF", choices=["auto", "hf", "vllm"])
    vllm_eager: bool = arg(False, "vLLM: skip compiling the model (starts in ~20 s instead of ~80 s on 2 cores; "
                                  "decodes slower)")
    vllm_gpu_memory: float = arg(0.5, "vLLM: share of the GPU memory for weights and KV cache")
    vllm_kv_tokens: int = arg(0, "vLLM on a CPU: tokens of KV cache (0: a step's episodes x --max-context, at most "
                                 "a quarter of RAM); lower it to run two jobs side by side on one machine")
    temperature: float = arg(1.0, "sampling temperature")
    top_p: float = arg(1.0, "nucleus sampling")
    max_new_tokens: int = arg(64, "tokens per assistant turn")
    max_context: int = arg(4096, "tokens per trajectory")
    # Held-out evaluation (the env's test split, sampled at --temperature as in the paper)
    eval_every: int = arg(15, "held-out evaluation every N steps, and before the first and after the last (0: never)")
    eval_tasks: int = arg(52, "test tasks per evaluation, spread over the split (0: all)")
    eval_batch: int = arg(64, "held-out episodes played at once: env instances, beside training's (SciWorld: JVMs)")
    eval_turns: int | None = arg(None, "horizon of the evaluation episodes (default: the schedule's largest)")
    eval_samples: int = arg(1, "episodes per test task in each evaluation (success: the mean over all of them)")
    # Run
    seed: int = arg(0, "seed of task order, sampling and init")
    out: str | None = arg(None, "run folder (default runs/{env}__{algo}__{seed}__{time})")
    resume: bool = arg(False, "continue the run in --out from its checkpoint")
    save_every: int = arg(0, "checkpoint every N steps (0: only at the end; -1: never, but on Ctrl-C or SIGTERM)")
    report_to: str = arg("none", "also log metrics, evaluations and the config to TensorBoard (OUT/tensorboard) or "
                                 "W&B (WANDB_MODE=offline works)", choices=list(REPORTERS))
    device: str = arg("auto", "cpu, cuda or auto")
    dtype: str = arg("auto", "compute dtype of generation and the update; weights and optimizer stay fp32. auto: bf16 "
                             "on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX) for models of 10M parameters "
                             "or more, else fp32 (the built-in tiny model)", choices=["auto", "fp32", "bf16"])
    threads: int = arg(0, "CPU threads for torch per process (0: during rollouts all cores but one, which the env "
                          "server needs, during the update all; shared by the processes of this node). Cores "
                          "shared with other runs: give each --threads 1 (cli.cpu_threads)")
    cache_dir: str = arg(os.path.expanduser("~/.cache/agentgym-rl-mini"), "where built-in models are built once")
    # Faults (docs/reliability.md)
    env_timeout: float = arg(120.0, "seconds an env server may take for one call; past it: an env error")
    max_env_error_share: float = arg(0.5, "a step with a larger share of env-error trajectories is not trained on")
    env_error_patience: int = arg(3, "stop, with a checkpoint, after this many such steps in a row")
    env_wait: float = arg(120.0, "after such a step, seconds to wait for the env server (a local one is restarted)")

