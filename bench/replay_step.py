r"""Replay one recorded step through the update under several settings: how far each moves the
policy.

    python bench/replay_step.py RUN --step 1 --try lr=1e-5,kl_coef=0 --try lr=1e-6 \
        --try lr=1e-6,mini_batch_size=8

The trajectories of RUN/rollouts/step_N.jsonl go through train.update once per setting, each time
from the same start: the run's initial policy, an HF folder (--weights FOLDER), or a checkpoint
(--weights RUN/checkpoint or a copy of one: its model/, optimizer state, lr_scale and the update's
shuffle stream, so that step N replayed from the checkpoint of step N-1 is the run's own update, its
logged update_kl).
A setting is a comma list of train.py fields (`lr`, `kl_coef`, `mini_batch_size`, `ppo_epochs`, ...)
over the run's own config.json. For each it prints:
- update_kl: KL(before || after) per sampled token of the step (the metric train.py logs each step);
- the probe: mean NLL per token of expert trajectories on held-out tasks (--probe-tasks of the test
  split), before and after: a rise means the update pushed the policy away from good behaviour that
  the step's rows do not show;
- clip_frac and grad_norm of the update, and its seconds (the passes before it included);
- vs_own: KL(the run's own setting's result || this setting's result) per sampled token of the step
  (k3 on the step's tokens): whether a setting changes the update's result, on the scale of
  update_kl (0 for the run's own setting).
The KL reference is always the run's initial policy, also when --weights starts from elsewhere.
Settings are chosen in minutes this way, not in hours of RL. The recorded log-probs are the
sampler's at that step: replaying step 1 of a run from its initial weights, or step N from step
N-1's checkpoint, is exact (ratio 1 at the start); a later step from other weights, or from an HF
folder with a fresh optimizer (whose first steps are larger), is an approximation (say which you
report). A run with dynamic sampling logged every round; the replay trains, as the run did, on the
informative groups.
"""

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import algos  # noqa: E402
import train  # noqa: E402

from trainer import checkpoints
from trainer import setup as run_setup  # noqa: E402
from trainer.setup import update_run  # noqa: E402
from trainer.cli import cpu_threads  # noqa: E402
from models.builtin import resolve  # noqa: E402
from distributed import Precision  # noqa: E402
from models.policy import (load_model, load_tokenizer, pad_id,  # noqa: E402
                           token_logprobs)
from distributed import build_batch  # noqa: E402
from rollout import ChatFormat, informative_groups  # noqa: E402
from recipes.sft import load_log  # noqa: E402


def parse_setting(text: str) -> list[str]:
    """'lr=1e-6,kl_coef=0' -> ['--lr', '1e-6', '--kl-coef', '0']."""
    flags = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise SystemExit(f"--try {text!r}: expected field=value pairs, got {part!r}")
        flags += [f"--{key.strip().replace('_', '-')}", value.strip()]
    return flags


def probe_rows(cfg, fmt, n: int):
    """Expert trajectories on n held-out tasks (the env's test split), or [] when the env has no
    expert."""
    from env_server import get_env_class
    from models.warmstart import expert_trajectories

    cls = get_env_class(cfg.env)
    test = list(cls.splits(cls.load_world(None)).get("test", []))[:n]
    try:
        return expert_trajectories(cfg.env, test, fmt, max_turns=30, progress=False) if test else []
    except (NotImplementedError, AttributeError):
        return []


def probe_nll(model, rows, pad: int, temperature: float) -> float:
    if not rows:
        return float("nan")
    batch = build_batch(rows, pad)
    mask = batch["loss_mask"][:, 1:]
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(rows)):
            mb = {k: batch[k][i:i + 1] for k in algos.INPUTS}
            lp, _ = token_logprobs(model, mb, temperature, mask=mask[i:i + 1])
            total, tokens = total - float(lp.sum()), tokens + float(mask[i].sum())
    return total / max(tokens, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder (config.json, rollouts/)")
    p.add_argument("--step", type=int, default=1, help="the recorded step to replay")
    p.add_argument("--try", dest="settings", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a setting to replay (repeatable); the run's own settings are always "
                        "replayed first")
    p.add_argument("--weights", default=None,
                   help="starting weights: an HF folder, or a checkpoint folder (model/, optim.pt, "
                        "trainer_state.pt); default: the run's initial policy")
    p.add_argument("--probe-tasks", type=int, default=4,
                   help="held-out tasks whose expert trajectories are the probe")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    config = os.path.join(a.run, "config.json")
    log = os.path.join(a.run, "rollouts", f"step_{a.step:06d}.jsonl")
    for path, what in ((config, "config.json"), (log, f"the log of step {a.step}")):
        if not os.path.exists(path):
            raise SystemExit(f"replay_step.py: {a.run} has no {what} ({path})")
    settings = [[]] + [parse_setting(s) for s in a.settings]
    # parse_args wants an --out that holds no run; nothing is written
    scratch = os.path.join(a.run, ".replay")
    cfgs = [train.parse_args(["--config", config, "--out", scratch, "--eval-every", "0", *f])
            for f in settings]
    torch.set_num_threads(cpu_threads(a.threads, leave_one=False))
    base = cfgs[0]
    ckpt = a.weights if a.weights and os.path.exists(os.path.join(a.weights, "optim.pt")) else None
    init = (os.path.join(ckpt, "model") if ckpt
            else a.weights or resolve(base.model, base.env, base.cache_dir))
    tok = load_tokenizer(init)
    fmt, pad = ChatFormat(tok), pad_id(tok)
    master0 = load_model(init)
    initial = resolve(base.model, base.env, base.cache_dir)  # the KL reference, as in the run
    ref0 = master0 if initial == init else load_model(initial)
    trajs = load_log(log)
    if base.dynamic_sampling:
        # the step trained on the groups whose scores differ, from every round
        keep = informative_groups(trajs)
        trajs = [t for t in trajs if t.group in keep]
    if not trajs:
        raise SystemExit(f"replay_step.py: step {a.step} of {a.run} has no group whose scores "
                         "differ: its update had nothing to train on")
    probe = probe_rows(base, fmt, a.probe_tasks)
    print(f"step {a.step} of {a.run}: {len(trajs)} trajectories, "
          f"{sum(sum(t.loss_mask) for t in trajs)} sampled tokens; probe: {len(probe)} expert "
          f"trajectories on held-out tasks; weights {init}")
    print(f"{'setting':42s} {'update_kl':>10s} {'probe NLL':>19s} {'clip_frac':>9s} "
          f"{'grad_norm':>9s} {'s':>5s} {'vs_own':>9s}")
    results, own_lp = [], None
    for flags, cfg in zip(settings, cfgs):
        torch.manual_seed(cfg.seed)
        master = copy.deepcopy(master0).train()
        dtype = run_setup.compute_dtype(cfg, torch.device("cpu"), master)
        ref = Precision(copy.deepcopy(ref0).eval(), dtype).model if cfg.kl_coef > 0 else None
        optims = {"policy": torch.optim.AdamW(master.parameters(), lr=cfg.lr,
                                              weight_decay=cfg.weight_decay)}
        run = update_run(cfg, master, optims, dtype, ref=ref, pad=pad)
        prec = run.prec
        if ckpt:
            # the run's optimizer moments, learning-rate scale and shuffle stream at that point
            st = checkpoints.load_checkpoint(ckpt, master, None, run.optims)
            run.lr_scale = st.get("lr_scale", 1.0)
            rng = st["rank_rngs"][0]
            if "update_gen" in rng:
                run.update_gen.set_state(rng["update_gen"])
            elif not results:
                print("the checkpoint predates the update's own shuffle stream: this replay "
                      "shuffles otherwise than the run did (an approximation)")
        lr = train.set_lr(run, a.step)
        before = probe_nll(prec.model, probe, pad, cfg.temperature)
        t0 = time.time()
        rows = train.Rows(run, trajs)
        m = train.update(run, rows, *train.advantages(run, rows))
        seconds = time.time() - t0
        after = probe_nll(prec.model, probe, pad, cfg.temperature)
        mask = rows.batch["loss_mask"][:, 1:]
        lp = rows.passes(lambda mb, mb_mask: token_logprobs(prec.model, mb, cfg.temperature,
                                                            mask=mb_mask)[0])
        own_lp = lp if own_lp is None else own_lp
        sel = mask > 0
        vs_own = float(algos.kl_penalty(own_lp, lp, "k3", None)[sel].mean()) if sel.any() else 0.0
        name = " ".join(flags) or "(the run's own settings)"
        kl, clip = m["update_kl"], m["clip_frac"]  # None: no row moved
        nan = float("nan")
        print(f"{name[:42]:42s} {nan if kl is None else kl:10.2e} {before:8.4f} -> "
              f"{after:8.4f} {nan if clip is None else clip:9.3f} {m['grad_norm']:9.3f} "
              f"{seconds:5.0f} {vs_own:9.2e}", flush=True)
        results.append({"setting": name, "lr": lr, "update_kl": kl, "probe_nll_before": before,
                        "probe_nll_after": after, "clip_frac": m["clip_frac"],
                        "grad_norm": m["grad_norm"],
                        "seconds": seconds, "vs_own": vs_own})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
