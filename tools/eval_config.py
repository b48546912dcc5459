"""eval.py's flags (`EvalConfig`: the essential ones first, then the groups) and their checks:
`parse_args` refuses a bad combination with one line, and takes a training run's settings where
--checkpoint names one and no flag says otherwise."""

from __future__ import annotations

import dataclasses
import os

from env_server.agents import SCHEMES, has_chance
from tools import endpoint, eval_outputs, paired, run_settings
from trainer import cli

arg = cli.arg  # a flag: its default, its help in -h


@dataclasses.dataclass
class EvalConfig(cli.Shared):
    # What to evaluate
    split: str = arg("test", "task split to evaluate (the server's /tasks splits)")
    tasks_file: str | None = arg(None, "JSON task ids: {\"test\": [...], ...} or a list (the "
                                       "--split tasks): ints, \"<env>_<n>\" or {\"item_id\": n}",
                                 group='what to evaluate')
    limit: int | None = arg(None, "evaluate only the first N tasks of the split")
    # Policy: one of checkpoint, model, endpoint; none of them: the built-in tiny model
    checkpoint: str | None = arg(None, "a training run folder (or its checkpoint/): its model, "
                                       "played with the run's env, agent, horizon and sampling "
                                       "unless flags say else")
    random: bool = arg(False, "a random policy, no model: chance (each turn a move drawn uniformly "
                              "from the game's, agents.random_moves); with --checkpoint, at that "
                              "run's settings", group='policy')
    endpoint: str | None = arg(None, "OpenAI-compatible base URL, e.g. http://host:8000/v1",
                               group='policy')
    endpoint_model: str | None = arg(None, "model name to send to the endpoint", group='policy')
    endpoint_timeout_s: float = arg(120.0, "seconds per chat request, its whole answer included",
                                    group='policy')
    endpoint_max_answer_kb: int = arg(512, "KiB a chat answer may hold; a longer one is the "
                                           "request's error", group='policy')
    endpoint_max_context_kb: int = arg(2048, "KiB a chat request (the whole dialogue) may hold; "
                                             "past it the episode ends as context_limit",
                                       group='policy')
    endpoint_retries: int = arg(2, "extra attempts per failed chat request (no game is touched)",
                                group='policy')
    endpoint_workers: int = arg(16, "chat requests in flight at once", group='policy')
    # Sampling
    n: int = arg(4, "samples per task (Avg@n, Pass@n)")
    greedy: bool = arg(False, "temperature 0; forces n = 1", group='sampling')
    top_p: float = arg(1.0, "nucleus sampling", group='sampling')
    max_turns: int = arg(30, "assistant turns per episode (the horizon K)")
    agent: str = arg("react", "agent scheme (agents.SCHEMES): react (Thought/Action), plan (plan "
                     "first), reflect (retry after a failure)", choices=lambda: sorted(SCHEMES),
                     group='sampling')
    max_context: int = arg(4096, "tokens per trajectory (local engine)", group='sampling')
    batch: int = arg(64, "episodes played at once (env instances)", group='sampling')
    vllm_kv_tokens: int = arg(0, "vLLM on a CPU: tokens of KV cache (0: --batch, or the episodes "
                                 "where fewer, x --max-context, at most a quarter of RAM)",
                               group='sampling')
    # Run
    out: str | None = arg(None, "result JSON (default: RUN_DIR/eval_SPLIT.json, else "
                                "eval_ENV_SPLIT.json)")
    device: str = arg("auto", "cpu, cuda or auto", group='run')
    curriculum: str | None = arg(None, "also write FILE: the ids of the tasks solved only "
                                       "sometimes, for --tasks-file (n >= 2, sampled, train split)",
                                 group='run')
    overwrite: bool = arg(False, "replace the result --out already holds (without it, such an "
                                 "--out is refused: an earlier --compare may read it)",
                          group='run')
    compare: str | None = arg(None, "START.json,END.json (a side may pool A.json+B.json): compared "
                                    "task by task, a 95% interval (and a sign test where every "
                                    "score is 0 or 1); plays nothing")


def parse_args(argv=None, doc: str = "") -> EvalConfig:
    p, cfg = cli.parse_config(EvalConfig, argv, doc, "eval.py", adapt=run_settings.from_run)
    if cfg.compare is not None:
        if wrong := paired.compare_spec_error(cfg.compare):  # two result files of this script
            p.error(f"--compare: {wrong}")
        return cfg
    if sum(x is not None for x in (cfg.checkpoint, cfg.model, cfg.endpoint)) > 1:
        p.error("give at most one of --checkpoint, --model, --endpoint")
    if cfg.random and (cfg.model or cfg.endpoint):
        p.error("--random plays no model: leave out --model and --endpoint")
    if cfg.endpoint and not cfg.endpoint_model:
        p.error("--endpoint needs --endpoint-model: the model name the server serves")
    if cfg.endpoint and (wrong := endpoint.address_error(cfg.endpoint)):
        p.error(f"--endpoint: {wrong}")
    if cfg.checkpoint:
        run_settings.take(p, cfg)  # the run's env, horizon and sampling, where no flag is given
    cli.check_positive(p, cfg, ("n", "max_turns", "max_new_tokens", "batch", "limit",
                                "endpoint_max_answer_kb", "endpoint_max_context_kb"))
    cli.check_ranges(p, cfg, {"temperature": "[0, inf)", "top_p": "(0, 1]",
                              "vllm_kv_tokens": "[0, inf)", "endpoint_retries": "[0, inf)",
                              "endpoint_timeout_s": "(0, inf)", "endpoint_workers": "[1, inf)"})
    if not -2 ** 63 <= cfg.seed < 2 ** 64:  # torch's generators take no more: a traceback, late
        p.error(f"--seed {cfg.seed}: a seed must fit in 64 bits")
    cli.check_device(p, cfg.device)
    cli.check_env(p, cfg)
    if cfg.random and not has_chance(cfg.env):
        p.error(f"--random: {cfg.env} defines no random policy (agents.register_env's "
                "random_moves)")
    cli.check_model(p, cfg.model)
    eval_outputs.check_curriculum(p, cfg)  # sampled, n >= 2, not on the test split
    if cfg.greedy:
        if cfg.n != 1:
            print(f"--greedy: temperature 0 plays each task the same way; n forced from {cfg.n} "
                  "to 1")
        cfg.n, cfg.temperature = 1, 0.0
    if cfg.out is None:
        cfg.out = (os.path.join(run_settings.run_folder(cfg.checkpoint), f"eval_{cfg.split}.json")
                   if cfg.checkpoint else f"eval_{cfg.env}_{cfg.split}.json")
    check_files(p, cfg)
    eval_outputs.check_partial(p, cfg)  # a cut evaluation in OUT.partial.jsonl has these settings
    return cfg


def settings_of(path: str) -> str:
    """A few words on the settings of the result in `path` (its policy, n, K), for a refusal."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        return (f" ({c.get('policy')}, n {c['config']['n']}, --max-turns "
                f"{c['config']['max_turns']})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


def check_files(p, cfg: EvalConfig) -> None:
    """--out and --curriculum: files that can be made in folders this process may write in, and
    not the same file (the task list would replace the result); checked before anything plays,
    not when the evaluation ends."""
    named = [("--out", cfg.out, "the result's JSON file")]
    if cfg.curriculum is not None:
        named.append(("--curriculum", cfg.curriculum, "the file the task ids are written to"))
    for flag, path, what in named:
        cli.check_writable(p, flag, path, what, folder=False)
    if os.path.isfile(cfg.out) and not cfg.overwrite:
        p.error(f"--out {cfg.out} already holds a result{settings_of(cfg.out)}: give another "
                "--out, or --overwrite to replace it")
    if cfg.curriculum is not None:
        log = os.path.splitext(cfg.out)[0] + ".rollouts.jsonl"
        mine = {os.path.realpath(x) for x in (cfg.out, log, eval_outputs.partial_path(cfg.out))}
        if os.path.realpath(cfg.curriculum) in mine:
            p.error(f"--curriculum {cfg.curriculum} is a file --out {cfg.out} writes: give "
                    "another path")
