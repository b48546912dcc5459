"""Avg@n / Pass@n of a policy on an environment's test tasks, overall and per category.

    python eval.py --env textcraft --checkpoint runs/textcraft__grpo__0__A  # a run's
    python eval.py --env babyai --model Qwen/Qwen2.5-3B-Instruct --n 8      # an HF model
    python eval.py --env textcraft --endpoint http://host:8000/v1 --endpoint-model qwen
    python eval.py --compare start.json,end.json+end2.json    # two results, task by task

Each task is played n times through rollout.rollout, the loop training uses. With s_ij the
env's score of sample j of task i: Avg@n = mean_i(mean_j s_ij), as in AgentGym-RL, and
Pass@n = the share of tasks with a success among their n samples, success being training's
one rule (rollout.is_success: the env ended the episode with a score above 0), overall and
per category. An infrastructure error is left out and counted, never 0.
Writes OUT and OUT.rollouts.jsonl (`python -m tools.viewer OUT`); prints a table. After a cut
(a crash, Ctrl-C: one line, exit 130), the same command continues from OUT.partial.jsonl. A
game the calling script registered is served on a thread of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
# before torch loads OpenMP (cli.cpu_threads sets the thread count)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import sys
import time

import torch

from env_server.agents import has_chance
from rollout import (EnginePolicy, RandomPolicy, RolloutConfig, Trajectory, is_success,
                     play_in_chunks)
from tools import endpoint, eval_config, eval_outputs, paired  # the flags; named features
from tools.loading import dtype_name, load_local  # a checkpoint, HF or built-in model
from trainer import cli  # the env server (cli.serving_env), the task lists, the thread count
from trainer.held_out import CHANCE_SAMPLES, categories_for, player  # training's, shared
from trainer.run import outcomes, write_log  # the episodes' counts and log, as training's


def parse_args(argv=None) -> eval_config.EvalConfig:
    return eval_config.parse_args(argv, __doc__)


def main(cfg: eval_config.EvalConfig) -> dict:
    if cfg.compare:
        return paired.compare_results(cfg.compare)  # two results compared; nothing is played
    try:
        with cli.serving_env(cfg.env, cfg.env_addr) as (url, _):
            return evaluate(cfg, url)
    except KeyboardInterrupt:
        print(f"Ctrl-C: stopped; {kept(cfg)}", file=sys.stderr, flush=True)
        sys.exit(130)


def kept(cfg: eval_config.EvalConfig) -> str:
    """What a cut evaluation leaves: the ended chunks of episodes, in OUT.partial.jsonl."""
    path = eval_outputs.partial_path(cfg.out)
    if not os.path.exists(path):
        return "no chunk of episodes had ended: nothing written"
    with open(path, encoding="utf-8") as f:
        episodes = sum(1 for _ in f) - 1  # after the line of settings
    return f"{episodes} episodes kept in {path}: the same command continues from them"


def evaluate(cfg: eval_config.EvalConfig, url: str) -> dict:
    t0 = time.time()
    served_elsewhere = cfg.env_addr is not None
    listed = cli.task_lists(url, cfg.env, cfg.tasks_file, cfg.split, given=served_elsewhere)
    if cfg.split not in listed["splits"]:
        raise SystemExit(f"--split {cfg.split!r}: the server has {sorted(listed['splits'])}")
    tasks = list(listed["splits"][cfg.split])[: cfg.limit]
    category = categories_for(cfg.env, tasks, listed["categories"])
    # Episode e plays tasks[e // n] as its sample e % n; its group is the task's position.
    episodes = [(g, item, j) for g, item in enumerate(tasks) for j in range(cfg.n)]
    rcfg, generator, policy_dtype = RolloutConfig.of(cfg, cfg.max_turns), None, None
    # chance's text replies; a chat endpoint's; else a local model samples on its engine
    if cfg.random:
        policy, fmt, name, kind = RandomPolicy(cfg.env, cfg.seed), None, "random", "random"
    elif cfg.endpoint:
        policy, fmt, name, kind = endpoint.policy(cfg), None, endpoint.name(cfg), "endpoint"
    else:
        torch.set_num_threads(cli.cpu_threads(cfg.threads))
        engine, fmt, name, where, kind = load_local(cfg, len(episodes))
        generator = torch.Generator(where).manual_seed(cfg.seed)  # where the engine samples
        policy = EnginePolicy(engine, fmt, rcfg, generator)
        policy_dtype = dtype_name(engine.dtype)
    print(f"eval {cfg.env}/{cfg.split}: {len(tasks)} tasks x n={cfg.n}, K={cfg.max_turns}, "
          f"temperature {cfg.temperature:g}, policy {name}")
    play = player(policy, cfg.env, rcfg, fmt, cfg.agent)
    # absolute: write_log makes the file's folder, which a bare file name lacks
    log = os.path.abspath(os.path.splitext(cfg.out)[0] + ".rollouts.jsonl")
    items, groups = [e[1] for e in episodes], [e[0] for e in episodes]
    with eval_outputs.resumable(cfg, len(episodes), generator) as (played, chunk_done):
        trajs = played if len(played) == len(episodes) else play_in_chunks(
            url, cfg.batch, items, groups, play, desc="eval",
            played=played, chunk_done=chunk_done)
        table = scores(episodes, trajs, category)
        statuses = outcomes(trajs)["statuses"]
        result = {"config": dataclasses.asdict(cfg), "policy": name, "n": cfg.n,
                  "n_scored": table.pop("n"), **table, "statuses": statuses,
                  # "excluded" (errors left out), "behaviour", "tasks" (per-task scores)
                  **eval_outputs.details(tasks, category, episodes, trajs),
                  "time_s": time.time() - t0, "engine": kind,
                  "dtype": policy_dtype,  # what --dtype resolved to here; None: an endpoint's
                  # a random policy on the same tasks and horizon, beside every rate
                  "chance": None if cfg.random else chance(cfg, url, tasks, category)}
        write_log(log, 0, cfg.max_turns, trajs)
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)
    eval_outputs.print_table(result)  # per category, then statuses and the errors left out
    print(f"wrote {os.path.abspath(cfg.out)} and {log}")
    if cfg.curriculum:
        eval_outputs.write_curriculum(result, cfg.curriculum)  # tasks solved only sometimes
    return result


def scores(episodes: list[tuple], trajs: list[Trajectory], category: dict) -> dict:
    """score_table of the played episodes (group, item, sample): env errors are left out, never
    scored 0."""
    return score_table([(item, category[item], j, t.reward, is_success(t))
                        for (_, item, j), t in zip(episodes, trajs) if t.status != "env_error"])


def chance(cfg, url: str, tasks: list[int], category: dict) -> dict | None:
    """The random policy's (rollout.RandomPolicy) Avg@n and Pass@n on the tasks and horizon a
    policy played, from N = max(n, CHANCE_SAMPLES) samples a task: Avg@n is their mean, Pass@n
    the unbiased estimate 1 - C(N - c, n) / C(N, n) for c successes in N (the chance that n
    samples of them hold one). None where the game defines no random policy."""
    if not has_chance(cfg.env):
        return None
    N = max(cfg.n, CHANCE_SAMPLES)
    items = [item for item in tasks for _ in range(N)]
    rcfg = RolloutConfig.of(cfg, cfg.max_turns)
    play = player(RandomPolicy(cfg.env, cfg.seed), cfg.env, rcfg, None, cfg.agent)
    trajs = play_in_chunks(url, cfg.batch, items, [k // N for k in range(len(items))], play,
                           desc="chance", leave=False)
    per_task: dict = {}
    for t in trajs:
        if t.status != "env_error":  # left out, never scored 0
            per_task.setdefault(t.item_id, []).append((t.reward, is_success(t)))

    def summary(ids: list[int]) -> dict:
        rows = [per_task[i] for i in ids if i in per_task]
        k = max(1, len(rows))
        return {"tasks": len(rows), "samples": sum(map(len, rows)),
                f"avg@{cfg.n}": sum(sum(r for r, _ in x) / len(x) for x in rows) / k,
                f"pass@{cfg.n}": sum(pass_at(cfg.n, len(x), sum(w for _, w in x))
                                     for x in rows) / k}

    cats = sorted({category[i] for i in tasks})
    return {"samples_per_task": N, "overall": summary(tasks),
            "by_category": {c: summary([i for i in tasks if category[i] == c]) for c in cats}}


def pass_at(n: int, N: int, c: int) -> float:
    """The chance that n of N samples, c of them successes, hold one: 1 - C(N-c, n) / C(N, n)
    (with fewer than n samples, whether any succeeded)."""
    return float(c > 0) if N < n else 1.0 - math.comb(N - c, n) / math.comb(N, n)


def score_table(rows) -> dict:
    """Avg@n, Pass@n from (item_id, category, sample_index, score, success) rows of scored
    samples, n the most a task has (one with fewer, after errors, averages what it has) ->
    {"n", "overall", "by_category": {category: ...}}, each {"tasks", "samples", "avg@n",
    "pass@n"}."""
    per_task: dict = {}
    for item_id, category, _sample, score, success in rows:
        per_task.setdefault((category, item_id), []).append((float(score), bool(success)))
    n = max(map(len, per_task.values()), default=0)

    def summary(samples: list[list[tuple]]) -> dict:
        t = max(1, len(samples))
        return {"tasks": len(samples), "samples": sum(map(len, samples)),
                f"avg@{n}": sum(sum(s for s, _ in x) / len(x) for x in samples) / t,
                f"pass@{n}": sum(any(won for _, won in x) for x in samples) / t}

    return {"n": n, "overall": summary(list(per_task.values())),
            "by_category": {c: summary([s for (k, _), s in per_task.items() if k == c])
                            for c in sorted({c for c, _ in per_task})}}


if __name__ == "__main__":
    main(parse_args())
