"""What eval.py writes and prints besides computing Avg@n / Pass@n (its table: `print_table`).

- OUT.partial.jsonl: each chunk of episodes as it ends (`resumable`), so that the same command
  after a cut plays only the chunks left, each from the seed the uncut run would have used.
- OUT's per-task rows, its excluded errors (env server or chat endpoint) and `behaviour` (turns per
  success, repeated actions): `details`.
- --curriculum FILE: the ids of the tasks solved only sometimes, for train.py --tasks-file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os

from env_server.agents import parse_action
from rollout import Trajectory
from trainer.run import outcomes
from tools.endpoint import is_endpoint_error

# ---------------------------------------------------------------- a cut evaluation, continued
# Fields that do not change what is played: a cut evaluation continues under other values of these.
FREE_TO_CHANGE = ("out", "threads", "curriculum", "endpoint_workers", "endpoint_timeout_s",
                  "endpoint_retries", "endpoint_max_answer_kb", "vllm_kv_tokens",
                  "env_max_answer_mb")


def partial_path(out: str) -> str:
    return out + ".partial.jsonl"


def play_settings(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in FREE_TO_CHANGE}


def read_partial(cfg) -> list[Trajectory]:
    """The trajectories of the chunks a cut evaluation finished (OUT.partial.jsonl: a line of
    settings, then one trajectory per line); ValueError, naming the file, where its settings are not
    cfg's."""
    path = partial_path(cfg.out)
    try:
        with open(path, encoding="utf-8") as f:
            head, *lines = [json.loads(x) for x in f if x.strip()]
        settings = head["settings"]
        fields = Trajectory.__dataclass_fields__
        trajs = [Trajectory(**{k: d[k] for k in fields if k in d}) for d in lines]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a cut evaluation of eval.py ({type(e).__name__}: {e}); "
                         "remove it") from None
    mine = play_settings(cfg)
    differ = [k for k in sorted(set(mine) | set(settings))
              if k not in FREE_TO_CHANGE and mine.get(k) != settings.get(k)]
    if differ:
        k = differ[0]
        raise ValueError(f"{path} holds a cut evaluation with --{k.replace('_', '-')} "
                         f"{settings.get(k)}, not {mine.get(k)}: give its settings to continue it, "
                         "or remove it to start again")
    return trajs


def check_partial(p, cfg) -> None:
    """At parse time, before a model loads: a cut evaluation in OUT.partial.jsonl must be cfg's."""
    if os.path.exists(partial_path(cfg.out)):
        try:
            read_partial(cfg)
        except ValueError as e:
            p.error(str(e))


def write_partial(cfg, trajs: list[Trajectory]) -> None:
    path = partial_path(cfg.out)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(json.dumps({"settings": play_settings(cfg)}) + "\n")
        for t in trajs:
            f.write(json.dumps(dataclasses.asdict(t)) + "\n")
    os.replace(path + ".tmp", path)


def chunk_seed(seed: int, chunk: int) -> int:
    """The sampling seed of a chunk: --seed for the first, one drawn from (seed, chunk) for the
    others, so that a continued evaluation samples as the uncut one would have."""
    if chunk == 0:
        return seed
    return int(hashlib.sha256(f"eval {seed} chunk {chunk}".encode()).hexdigest()[:15], 16)


@contextlib.contextmanager
def resumable(cfg, episodes: int, generator=None):
    """Yields (played, chunk_done) for rollout.play_in_chunks: the trajectories a cut evaluation of
    cfg finished (none at first), and the callback that keeps each chunk in OUT.partial.jsonl.
    `generator` (None for a chat endpoint) is seeded for each chunk by `chunk_seed`. The file goes
    when the block ends without an error (OUT is written by then); a cut keeps it."""
    path = partial_path(cfg.out)
    played = read_partial(cfg) if os.path.exists(path) else []
    if played:
        print(f"continuing the cut evaluation in {path}: {len(played)} of {episodes} episodes "
              "played")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)

    def seed(chunk: int) -> None:
        if generator is not None:
            generator.manual_seed(chunk_seed(cfg.seed, chunk))

    def chunk_done(chunk: int, got: list[Trajectory]) -> None:
        played.extend(got)
        write_partial(cfg, played)
        seed(chunk + 1)

    seed(len(played) // max(1, min(cfg.batch, episodes)))
    yield list(played), chunk_done
    if os.path.exists(path):
        os.remove(path)


# ---------------------------------------------------------------- per task, and behaviour
def details(tasks: list, category: dict, episodes: list, trajs: list[Trajectory]) -> dict:
    """OUT's "excluded" (errors, by where they came from: left out, never scored 0), "behaviour" and
    "tasks" (per task: its category, the scores of its samples, its errors). `episodes` are
    eval.py's (group, task id, sample index), one per trajectory."""
    rows = {i: {"item_id": i, "category": category[i], "scores": [], "errors": 0} for i in tasks}
    excluded = {"env_error": 0, "endpoint_error": 0}
    for (_, item, _), t in zip(episodes, trajs):
        if t.status == "env_error":
            excluded["endpoint_error" if is_endpoint_error(t) else "env_error"] += 1
            rows[item]["errors"] += 1
        else:
            rows[item]["scores"].append(t.reward)
    played = [t for t in trajs if t.status != "env_error"]
    return {"excluded": excluded, "behaviour": behaviour(played), "tasks": list(rows.values())}


def behaviour(trajs: list[Trajectory]) -> dict:
    """What the episodes look like, in any env: the turns a success took, and the share of the
    agent's actions that repeat its action before in the same episode (a refused move tried again
    and again is the commonest way a small model fails). A reply without a valid action breaks a
    run of repeats."""
    actions = repeats = 0
    for t in trajs:
        before = None
        for m in t.messages[3:]:  # after the opening: instructions, acknowledgement, observation
            if m["role"] == "assistant":
                action = parse_action(t.env, m["content"]).action or None  # "": it named none
                actions += action is not None
                repeats += action is not None and action == before
                before = action
    return {"turns_per_success": outcomes(trajs)["turns_per_success"],
            "repeated_actions": repeats / actions if actions else None}


# ---------------------------------------------------------------- --curriculum FILE
def check_curriculum(p, cfg) -> None:
    """--curriculum's flags, checked before anything plays."""
    if cfg.curriculum is None:
        return
    if cfg.greedy:
        p.error("--curriculum needs sampled episodes; --greedy plays each task once, the same way")
    if cfg.n < 2:
        p.error(f"--curriculum needs --n 2 or more (got {cfg.n}): one sample per task cannot tell "
                "a task solved only sometimes")
    if cfg.split == "test":
        p.error("--curriculum: estimate it on the training split (--split train); a list from the "
                "test split would train on the held-out tasks")


def sometimes_solved(result: dict) -> list:
    """The ids of the tasks whose scored samples differ: for 0/1 scores, a pass rate strictly
    between 0 and 1. The only tasks whose GRPO groups can carry signal from the start (a group that
    ties has zero advantage), so a run trained on them wastes fewer rollouts."""
    return [t["item_id"] for t in result["tasks"] if len(set(t["scores"])) > 1]


def write_curriculum(result: dict, path: str) -> None:
    ids = sometimes_solved(result)
    scored = sum(1 for t in result["tasks"] if len(t["scores"]) > 1)
    if not ids:
        raise SystemExit(f"--curriculum: no task of the {scored} with 2 or more scored samples "
                         f"was solved only sometimes; {path} not written (try more samples, or a "
                         "policy between always and never)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(ids, f)
    print(f"curriculum: {len(ids)} of {scored} tasks solved only sometimes -> {path} "
          f"(train on them: train.py --tasks-file {path})")


def print_table(result: dict) -> None:
    """eval.py's table: Avg@n and Pass@n per category and overall, then `print_details`."""
    n, chance = result["n_scored"], result.get("chance")
    head = f"{'category':<24}{'tasks':>7}{'avg@' + str(n):>10}{'pass@' + str(n):>10}"
    if chance:  # the random policy's on the same episodes
        head += f"{'chance avg@' + str(n):>14}{'chance pass@' + str(n):>15}"
    print(head + "\n" + "-" * len(head))
    for name, row in [*result["by_category"].items(), ("overall", result["overall"])]:
        line = f"{name:<24}{row['tasks']:>7}{row[f'avg@{n}']:>10.3f}{row[f'pass@{n}']:>10.3f}"
        if chance:
            c = chance["overall"] if name == "overall" else chance["by_category"].get(name)
            line += (f"{c[f'avg@{n}']:>14.3f}{c[f'pass@{n}']:>15.3f}" if c and f"avg@{n}" in c
                     else f"{'-':>14}{'-':>15}")
        print(line)
    if chance is None and result.get("policy") != "random":
        print("chance: this game defines no random policy (agents.register_env's random_moves)")
    print_details(result)


def print_details(result: dict) -> None:
    """The lines under eval.py's table: statuses, the errors left out, and `behaviour`."""
    ex, b = result["excluded"], result.get("behaviour", {})
    print(f"statuses {result['statuses']}; excluded: {ex['env_error']} env errors, "
          f"{ex['endpoint_error']} endpoint errors")
    if b.get("repeated_actions") is not None:
        wins = "no success" if b["turns_per_success"] is None else \
            f"{b['turns_per_success']:.1f} turns per success"
        print(f"episodes: {wins}, {100 * b['repeated_actions']:.0f}% of actions repeat the one "
              "before")
