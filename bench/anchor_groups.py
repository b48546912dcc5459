"""How much step-level signal GiGPO finds in recorded trajectories: its anchor groups (the turns of
one group whose observation text is the same, algos.anchor_index) and the turns whose step
advantage is not 0, beside the trajectories whose episode advantage (GRPO's) is not 0.

    python bench/anchor_groups.py RUN --gamma 0.95                 # each recorded step of a run
    python bench/anchor_groups.py eval.json.rollouts.jsonl         # an evaluation: a task's samples

In a run's step logs a group is one task's samples in one step (resampled rounds of it included);
in an evaluation's log it is all samples of one task. Per log file it prints the trajectories,
groups and turns; `shared`: the share of turns in an anchor group of 2 or more (a group's first
turns always share the opening observation), `later`: the same for turns after the first, `size`:
the mean size of those anchor groups; `step!=0`: turns whose step advantage is not 0 (their anchor
group's discounted returns differ); `episode!=0`: trajectories whose episode advantage is not 0
(their group's outcomes differ, or a group of one scored). Then one JSON line. Without shared later
turns and at gamma 1, GiGPO's step level only adds the episode level again on the first turns.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import algos  # noqa: E402
from recipes.sft import load_log  # noqa: E402
from rollout import turn_state_keys  # noqa: E402


def anchor_stats(trajs: list, by_task: bool, gamma: float) -> dict:
    """The counts above for one batch of trajectories (groups by task, or by task and group)."""
    if not trajs:  # every row an env error
        return {"trajectories": 0, "groups": 0, "turns": 0, "shared": 0.0, "later": 0.0,
                "size": 0.0, "step_nonzero": 0.0, "episode_nonzero": 0.0}
    ids: dict = {}
    gids = torch.tensor([ids.setdefault(t.item_id if by_task else (t.item_id, t.group), len(ids))
                         for t in trajs])
    keys = [turn_state_keys(t) for t in trajs]
    anchors = algos.anchor_index(gids, keys)  # (B, K), -1 past a row's turns
    scores = torch.tensor([float(t.reward) for t in trajs])
    n_turns = [len(k) for k in keys]
    per_turn = [t.turn_rewards for t in trajs]
    if any(len(r) != n for r, n in zip(per_turn, n_turns)):
        per_turn = None  # an older log: the outcome on the last turn
    r = algos._turn_reward_matrix(scores, n_turns, per_turn, anchors.shape[1])
    step = algos.step_advantages(algos._reverse_discounted_cumsum(r, gamma), anchors)
    episode = algos.grpo_advantages(scores, gids)
    valid = anchors >= 0
    size = torch.bincount(anchors[valid]) if bool(valid.any()) else torch.zeros(0, dtype=torch.long)
    shared = torch.zeros_like(valid)
    shared[valid] = size[anchors[valid]] >= 2
    later = valid.clone()
    later[:, :1] = False
    turns = int(valid.sum())
    return {"trajectories": len(trajs), "groups": len(ids), "turns": turns,
            "shared": float(shared.sum()) / max(turns, 1),
            "later": float((shared & later).sum()) / max(int(later.sum()), 1),
            "size": float(size[size >= 2].float().mean()) if bool((size >= 2).any()) else 0.0,
            "step_nonzero": float(((step != 0) & valid).sum()) / max(turns, 1),
            "episode_nonzero": float((episode != 0).float().mean())}


def log_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "rollouts", "step_*.jsonl")) or
                       glob.glob(os.path.join(path, "step_*.jsonl")))
        if not files:
            sys.exit(f"anchor_groups.py: {path}: no step_*.jsonl trajectory logs in it or in its "
                     "rollouts/")
        return files
    if not os.path.isfile(path):
        sys.exit(f"anchor_groups.py: {path}: no such trajectory log or run folder")
    return [path]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a run folder, a step_*.jsonl file, or an evaluation's rollouts")
    p.add_argument("--gamma", type=float, default=0.95, help="GiGPO's discount (the paper's 0.95)")
    p.add_argument("--by", choices=["auto", "task", "group"], default="auto",
                   help="what makes a group: auto (step logs: task and group; else the task)")
    a = p.parse_args()
    if not 0 < a.gamma <= 1:
        sys.exit(f"anchor_groups.py: --gamma {a.gamma}: must lie in (0, 1]")
    rows = []
    print(f"{'log':<28} {'trajs':>6} {'groups':>6} {'turns':>6} {'shared':>7} {'later':>6} "
          f"{'size':>5} {'step!=0':>8} {'episode!=0':>10}")
    for f in log_files(a.log):
        by_task = a.by == "task" or (a.by == "auto" and not os.path.basename(f).startswith("step_"))
        s = {"log": f, **anchor_stats(load_log(f), by_task, a.gamma)}
        rows.append(s)
        print(f"{os.path.basename(f)[-28:]:<28} {s['trajectories']:>6} {s['groups']:>6} "
              f"{s['turns']:>6} {s['shared']:>7.1%} {s['later']:>6.1%} {s['size']:>5.1f} "
              f"{s['step_nonzero']:>8.1%} {s['episode_nonzero']:>10.1%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
