"""Avg@n / Pass@n evaluation of a policy on an environment's test tasks, overall and per category.

    python eval.py --env textcraft --checkpoint runs/textcraft__grpo__0__...  # a training run's checkpoint
    python eval.py --env babyai --model Qwen/Qwen2.5-3B-Instruct --n 8        # any HF model folder or hub name
    python eval.py --env textcraft --endpoint http://host:8000/v1 --endpoint-model qwen  # OpenAI-compatible
    python eval.py --env corridor --greedy                                     # the built-in tiny model

Each test task is played n times (sampled, temperature 1 by default; `--greedy` plays once at
temperature 0). With s_ij the score of sample j of task i (the env's reward: 0/1 for TextCraft, the
BabyAI score, ...):

    Avg@n  = mean_i ( mean_j s_ij )        Pass@n = mean_i [ max_j s_ij > 0 ]

as in AgentGym-RL's tables. Prompts, the chat template and action parsing are exactly training's
(agents.py: the scheme's opening messages and parsing; rollout.play_moves). A sample that ended in an
infrastructure error (env server, or the chat endpoint) is left out and counted, never scored 0; a task
whose every sample failed is left out of the averages. Categories come from the env's
`task_category(world, idx)` (TextCraft depth_k, BabyAI level, Corridor distance_k), read in-process;
envs without one (e.g. a remote WebArena) get a single category "all".

Writes OUT (JSON: config, per-task scores, overall and per-category avg@n / pass@n, status counts,
excluded errors) and OUT_DIR/eval_rollouts.jsonl (the trajectories, in the rollout log format), and
prints a table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agents import SCHEMES, make_agent
from env_client import EnvError, EnvPool, task_splits
from rollout import RolloutConfig, Trajectory, play_moves, start_trajectories, write_log
from train import arg, check_positive, check_served_elsewhere, config_parser

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
    checkpoint: str | None = arg(None, "a training run folder: loads RUN_DIR/checkpoint/model")
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
    agent: str = arg("react", "agent scheme: react (Thought/Action), plan (plan first, then act), reflect "
                              "(reflect and retry after a failed attempt)", choices=sorted(SCHEMES))
    max_new_tokens: int = arg(64, "tokens per assistant turn")
    max_context: int = arg(4096, "tokens per trajectory (local engine)")
    batch: int = arg(64, "episodes played at once (env instances)")
    # Run
    out: str | None = arg(None, "result JSON (default: RUN_DIR/eval_SPLIT.json, else eval_ENV_SPLIT.json)")
    seed: int = arg(0, "seed of sampling")
    device: str = arg("auto", "cpu, cuda or auto")
    threads: int = arg(0, "CPU threads for torch (0: all cores but one)")
    cache_dir: str = arg(os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini"),
                         "where the built-in tiny model is built once")


def parse_args(argv=None) -> EvalConfig:
    p = config_parser(EvalConfig, __doc__)
    cfg = EvalConfig(**vars(p.parse_args(argv)))
    if sum(x is not None for x in (cfg.checkpoint, cfg.model, cfg.endpoint)) > 1:
        p.error("give at most one of --checkpoint, --model, --endpoint")
    if cfg.endpoint and not cfg.endpoint_model:
        p.error("--endpoint needs --endpoint-model: the model name the server serves")
    check_positive(p, cfg, ("n", "max_turns", "max_new_tokens", "batch"))
    check_served_elsewhere(p, cfg)
    if cfg.greedy:
        if cfg.n != 1:
            print(f"--greedy: temperature 0 plays each task the same way; n forced from {cfg.n} to 1")
        cfg.n, cfg.temperature = 1, 0.0
    if cfg.out is None:
        cfg.out = (os.path.join(cfg.checkpoint, f"eval_{cfg.split}.json") if cfg.checkpoint
                   else f"eval_{cfg.env}_{cfg.split}.json")
    return cfg


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
    from env_server import ENVS, get_env_class

    if given:
        return {i: given.get(i, "all") for i in item_ids}
    if env not in ENVS:
        return {i: "all" for i in item_ids}
    cls = get_env_class(env)
    if not hasattr(cls, "task_category"):
        return {i: "all" for i in item_ids}
    world = cls.load_world(None)
    return {i: cls.task_category(world, i) for i in item_ids}


def play_in_chunks(url: str, size: int, items: list[int], groups: list[int], play, desc: str = "eval",
                   leave: bool = True, timeout: float = 120.0) -> list[Trajectory]:
    """Play episodes (task items[e], group groups[e]) on at most `size` env instances at once:
    play(pool, items, groups) -> trajectories, chunk by chunk. The last chunk is padded to the pool's
    size with copies, which are dropped after."""
    from tqdm import tqdm

    size = max(1, min(size, len(items)))
    trajs: list[Trajectory] = []
    with EnvPool(url, size, timeout=timeout) as pool:
        for s in tqdm(range(0, len(items), size), desc=desc, leave=leave, dynamic_ncols=True):
            its, gs = items[s:s + size], groups[s:s + size]
            got = play(pool, its + [its[-1]] * (size - len(its)), gs + [gs[-1]] * (size - len(gs)))
            trajs += got[: len(its)]
    return trajs


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


def endpoint_rollout(endpoint: ChatEndpoint, pool: EnvPool, env: str, item_ids: list[int], groups: list[int],
                     max_turns: int, workers: int = 16, agent: str = "react") -> list[Trajectory]:
    """rollout.rollout at the message level: the same agent scheme, opening messages, parsing and
    statuses, with the endpoint's chat template instead of token ids (token_ids, loss_mask and logprobs
    stay empty)."""
    agents = [make_agent(agent, env, max_turns) for _ in item_ids]
    trajs = start_trajectories(pool, env, item_ids, groups, agents)

    def ask(i: int):
        try:
            return endpoint.chat(trajs[i].messages)
        except EnvError as e:
            return e

    with ThreadPoolExecutor(max(1, min(workers, pool.size))) as ex:
        for _turn in range(max_turns):
            active = [i for i, t in enumerate(trajs) if not t.finished]
            if not active:
                break
            moves = {}
            for i, reply in zip(active, ex.map(ask, active)):
                t = trajs[i]
                if isinstance(reply, EnvError):  # counted and excluded, like an env error
                    t.status, t.error = "env_error", str(reply)
                    continue
                t.turns += 1
                t.messages.append({"role": "assistant", "content": reply})
                moves[i] = agents[i].act(reply)
            play_moves(pool, trajs, agents, moves, max_turns)
    for t in trajs:
        if not t.finished:
            t.status = "max_turns"
    return trajs


# ---------------------------------------------------------------- the local engine
def load_local(cfg: EvalConfig):
    """(engine, chat format, model path) for a checkpoint, an HF model, or the built-in tiny model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import train
    from checkpoints import find_checkpoint
    from rollout import ChatFormat, HFEngine

    if cfg.checkpoint:
        ckpt = find_checkpoint(cfg.checkpoint)
        if ckpt is None:
            sys.exit(f"--checkpoint: no checkpoint in {cfg.checkpoint} (expected {cfg.checkpoint}/checkpoint/model)")
        path = os.path.join(ckpt, "model")
    else:
        path = cfg.model or train.default_model_path(cfg.env, cfg.cache_dir)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    fmt = ChatFormat(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.eot_id
    return HFEngine(model, pad_id), fmt, path


# ---------------------------------------------------------------- the run
def main(cfg: EvalConfig) -> dict:
    server = None
    if cfg.env_addr is None:
        from env_server.app import ServerProcess
        server = ServerProcess(cfg.env)
    url = cfg.env_addr or server.url
    try:
        return evaluate(cfg, url)
    finally:
        if server is not None:
            server.stop()


def evaluate(cfg: EvalConfig, url: str) -> dict:
    import torch

    t0 = time.time()
    try:
        listed = task_splits(url, cfg.env, cfg.tasks_file, list_split=cfg.split)
    except ValueError as e:
        sys.exit(str(e))
    splits = listed["splits"]
    if cfg.split not in splits:
        sys.exit(f"--split {cfg.split!r}: the server has {sorted(splits)}")
    tasks = list(splits[cfg.split])[: cfg.limit]
    category = categories_for(cfg.env, tasks, listed["categories"])
    # Episode e plays task tasks[e // n] as its sample e % n; group = the task's position.
    episodes = [(g, item, j) for g, item in enumerate(tasks) for j in range(cfg.n)]

    if cfg.endpoint:
        endpoint = ChatEndpoint(cfg.endpoint, cfg.endpoint_model, cfg.temperature, cfg.top_p, cfg.max_new_tokens,
                                cfg.endpoint_timeout_s, cfg.endpoint_retries)
        policy = f"endpoint {cfg.endpoint} ({cfg.endpoint_model})"
    else:
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) - 1))
        engine, fmt, path = load_local(cfg)
        policy = path
        generator = torch.Generator(next(engine.model.parameters()).device).manual_seed(cfg.seed)  # where it samples
        rcfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                             max_context=cfg.max_context, temperature=cfg.temperature, top_p=cfg.top_p)
    print(f"eval {cfg.env}/{cfg.split}: {len(tasks)} tasks x n={cfg.n}, K={cfg.max_turns}, "
          f"temperature {cfg.temperature:g}, policy {policy}")

    from rollout import rollout

    def play(pool, items, groups):
        if cfg.endpoint:
            return endpoint_rollout(endpoint, pool, cfg.env, items, groups, cfg.max_turns, cfg.endpoint_workers,
                                    cfg.agent)
        return rollout(engine, fmt, pool, cfg.env, items, groups, rcfg, generator, agent=cfg.agent)

    trajs = play_in_chunks(url, cfg.batch, [e[1] for e in episodes], [e[0] for e in episodes], play)

    # -------- scores: errors are excluded and counted, never scored 0
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
    # n_scored: the n in the avg@n / pass@n keys; below n only when errors removed samples
    result = {"config": dataclasses.asdict(cfg), "policy": policy, "n": cfg.n, "n_scored": table.pop("n"),
              **table, "statuses": statuses, "excluded": excluded, "tasks": list(per_task.values()),
              "time_s": time.time() - t0}

    out_dir = os.path.dirname(os.path.abspath(cfg.out))
    os.makedirs(out_dir, exist_ok=True)
    write_log(os.path.join(out_dir, "eval_rollouts.jsonl"), 0, cfg.max_turns, trajs)
    with open(cfg.out, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)
    print(f"wrote {cfg.out} and {os.path.join(out_dir, 'eval_rollouts.jsonl')}")
    return result


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


if __name__ == "__main__":
    main(parse_args())
