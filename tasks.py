"""Task lists for the scripts: a server's /tasks, task files in this project's and the
original release's id formats, the defaults of envs served elsewhere (WebArena), ids spread
over a split."""

from __future__ import annotations

import json

from env_client import EnvError, Transport


# Envs served by other projects, whose servers have no /tasks: how many task ids they take.
REMOTE_TASKS = {"webarena": 812}  # WebArena's config_files/0.json .. 811.json
# The env part of an original-release item id ("textcraft_12") -> this project's env name.
ITEM_PREFIXES = {"textcraft": "textcraft", "babyai": "babyai", "sciworld": "sciworld",
                 "searchqa": "searchqa", "webarena": "webarena"}


def item_id(env: str, x, num_tasks: int | None = None) -> int:
    """A task id from an id list: an int, an original-release item id "<env>_<n>", or an
    object with an `item_id` field holding either. Raises ValueError for an id `env` does not
    have."""
    if isinstance(x, dict):
        if "item_id" not in x:
            raise ValueError("an id object needs an 'item_id' field, got keys "
                             f"{sorted(x)[:5]}")
        return item_id(env, x["item_id"], num_tasks)
    if isinstance(x, str):
        prefix, _, n = x.rpartition("_")
        if not prefix or not n.isdigit():
            raise ValueError(f"item id {x!r} is not of the form '<env>_<n>'")
        if ITEM_PREFIXES.get(prefix, prefix) != env:
            raise ValueError(f"item id {x!r} is for {prefix!r}, not {env!r}")
        x = int(n)
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError("a task id must be an integer, '<env>_<n>' or {'item_id': ...}, "
                         f"got {x!r}")
    if x < 0 or (num_tasks is not None and x >= num_tasks):
        raise ValueError(f"{env} has no task {x} (its tasks are 0..{(num_tasks or 1) - 1})")
    return x


def read_tasks_file(path: str, env: str, num_tasks: int | None, list_split: str) -> dict:
    """{"splits": {...}, "categories": {...}} from a JSON file:
    {"train": [...], "test": [...]} (or {"splits": {...}}, optionally
    "categories": {"12": "shopping"}), or a bare list of ids, which is the `list_split`
    split. Ids as `item_id` reads them."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, list):
            data = {list_split: data}
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object or list, got {type(data).__name__}")
        splits = data.get("splits", data)
        if not isinstance(splits, dict):
            raise ValueError("'splits' must be an object")
        for k in ("train", "test"):
            if k in splits and not isinstance(splits[k], list):
                raise ValueError(f"{k!r} must be a list of ids")
        splits = {k: [item_id(env, i, num_tasks) for i in v] for k, v in splits.items()
                  if isinstance(v, list)}
        categories = {int(k): str(v) for k, v in data.get("categories", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--tasks-file {path}: {e}") from None
    if not any(splits.values()) and not any(k in splits for k in ("train", "test")):
        raise ValueError(f"--tasks-file {path}: no id list ('train', 'test', or a bare list)")
    return {"splits": splits, "categories": categories}


def task_splits(url: str, env: str, tasks_file: str | None = None,
                list_split: str = "train") -> dict:
    """{"splits": {"train": [...], "test": [...]}, "categories": {id: name}} of `url`'s tasks.

    From the server's /tasks (this project's servers), else the defaults of an env served
    elsewhere: WebArena's 812 ids with every fifth one held out. A `tasks_file`
    (read_tasks_file) replaces the splits it lists; its ids are checked against the server's
    task count where it is known.
    """
    served = answer = None
    try:
        answer = Transport(url).request("GET", "/tasks", retry=True)
        served = {"num_tasks": int(answer["num_tasks"]), "splits": dict(answer["splits"])}
    except EnvError as e:
        if e.kind in ("timeout", "connection"):
            raise  # no server there at all: say so, rather than guess its tasks
        answer = e.message if e.status is None else f"{e.status}, {e.message}"
    except (KeyError, TypeError, ValueError):
        answer = f"GET /tasks: {json.dumps(answer)[:120]}"
    if served is None and env in REMOTE_TASKS:
        n = REMOTE_TASKS[env]
        served = {"num_tasks": n, "splits": {"train": [i for i in range(n) if i % 5],
                                             "test": list(range(0, n, 5))}}
    if tasks_file:
        given = read_tasks_file(tasks_file, env, served and served["num_tasks"], list_split)
        return {"splits": {**(served["splits"] if served else {}), **given["splits"]},
                "categories": given["categories"]}
    if served is None:  # (AgentGym's own servers list none: a --tasks-file gives them)
        answer = answer if len(answer) <= 100 else answer[:100] + "..."
        raise ValueError(f"{url} is not an env server of this project: it answered "
                         f"{answer} (an AgentGym env server lists no tasks: give them with "
                         "--tasks-file)")
    return {"splits": served["splits"], "categories": {}}


def spread(ids: list[int], k: int) -> list[int]:
    """k ids spread evenly over the list (all of them when k is 0 or too large)."""
    if not k or k >= len(ids):
        return list(ids)
    return [ids[i * len(ids) // k] for i in range(k)]
