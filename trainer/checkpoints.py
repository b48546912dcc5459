"""Saving, resuming and stopping a training run.

A checkpoint is OUT/checkpoint: model/ (an HF folder of full weights: what eval.py, sft.py and
vLLM load), optim.pt (each optimizer's state, and the critic's weights, as full tensors keyed
by parameter name, so that a run saved by N ranks resumes on any number) and trainer_state.pt
(step, schedule state, the data RNG, each rank's sampling and torch RNGs, the config). It is
written to checkpoint.tmp, synced and swapped in, so that an interrupted write never replaces
the last good one. (trainer/run.py's `Interrupts` turns Ctrl-C and SIGTERM into a stop that
--resume continues.)
"""

from __future__ import annotations

import json
import os
import shlex
import shutil

import torch

from distributed import barrier, global_rank


def save_checkpoint(out: str, model, tokenizer, critic, optims: dict, state: dict) -> None:
    """Collective under torchrun: every rank hands its shards to rank 0, which writes
    OUT/checkpoint.tmp and swaps it in, so an interrupted save never replaces a good one."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    # whole tensors, on rank 0's CPU only
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    owners = {"policy": model, "critic": critic}
    weights = get_model_state_dict(model, options=full)
    big = {"optims": {k: get_optimizer_state_dict(owners[k], o, options=full)
                      for k, o in optims.items()}}
    if critic is not None:
        big["critic"] = get_model_state_dict(critic, options=full)
    if global_rank() == 0:
        final, tmp, old = (os.path.join(out, n)
                           for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(os.path.join(tmp, "model"), state_dict=weights)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        torch.save(big, os.path.join(tmp, "optim.pt"))
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        # on disk before the swap: a power cut must not leave a renamed empty file
        _fsync_tree(tmp)
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(out)  # the renames themselves on disk: the folder's entries are data too
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def _fsync_tree(folder: str) -> None:
    """fsync each file and folder of the tree (a folder's fsync makes its entries durable)."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(ckpt: str, model, critic, optims: dict) -> dict:
    """Optimizer states and critic weights from `ckpt` into the (sharded or plain) modules,
    whatever the number of ranks that saved them; returns trainer_state.pt. The policy's
    weights are loaded before, from ckpt/model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

    # each rank cuts its shards out of the full tensors
    full = StateDictOptions(full_state_dict=True)
    st = load_data(os.path.join(ckpt, "trainer_state.pt"))
    big = load_data(os.path.join(ckpt, "optim.pt"), mmap=True)  # mmap: read, not copied
    owners = {"policy": model, "critic": critic}
    if set(optims) - set(big["optims"]) or (critic is not None and big.get("critic") is None):
        raise ValueError(f"{ckpt} was saved without a critic, which this run's --algo "
                         "trains: resume with the run's own --algo")
    for k, o in optims.items():
        set_optimizer_state_dict(owners[k], o, big["optims"][k], options=full)
    if critic is not None:
        set_model_state_dict(critic, big["critic"], options=full)
    return st


def load_data(path: str, **kw):
    """torch.load of plain data only (tensors, numbers, strings, lists, dicts): a pickle that
    would build any other object, and so could run code, is refused with a ValueError that
    names the file."""
    import pickle

    try:
        return torch.load(path, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds more than plain data, so it is not loaded (it could "
                         f"run code): {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, OSError) as e:  # cut short, damaged, unreadable
        why = (str(e).splitlines() or [""])[0]
        raise ValueError(f"{path} cannot be read: {type(e).__name__}: {why[:200]}") from None


def weights_problem(folder: str) -> str | None:
    """Why the model in `folder` (a checkpoint's) cannot be loaded, in one line, or None: no
    weights file, or one cut short or damaged (its header read, not its tensors)."""
    from safetensors import safe_open

    files = [f for f in sorted(os.listdir(folder)) if f.endswith((".safetensors", ".bin"))]
    if not files:
        return f"{folder} holds no model weights (*.safetensors, *.bin)"
    for name in (f for f in files if f.endswith(".safetensors")):  # a header to read
        try:
            with safe_open(os.path.join(folder, name), "pt"):
                pass
        except Exception as e:  # noqa: BLE001  # safetensors' own error type, any message
            return f"{os.path.join(folder, name)} cannot be read: {str(e)[:200]}"
    return None


def resume_command(out: str, script: str | None = None) -> str:
    """The command that continues the run in `out` (its config.json holds every other flag),
    as this process was started: plain python, or torchrun with as many processes per node;
    `script` by default train.py, or the user's script where it registered a game or an
    estimator of its own (train.py alone would not know them)."""
    script = script or launching_script()
    procs, world = os.environ.get("LOCAL_WORLD_SIZE"), int(os.environ.get("WORLD_SIZE", "1"))
    head = f"torchrun --nproc-per-node {procs}" if procs and world > 1 else "python"
    if procs and world > int(procs):  # several nodes: the same command on each, with its rank
        head = (f"torchrun --nnodes {world // int(procs)} --nproc-per-node {procs} "
                f"--node-rank R --master-addr {os.environ.get('MASTER_ADDR')} "
                f"--master-port {os.environ.get('MASTER_PORT')}")
    return f"{head} {script} --resume --out {shlex.quote(out)}"


def launching_script() -> str:
    """train.py, or the script this process runs (sys.argv[0]) where that script registered a
    game or an advantage estimator that train.py does not have."""
    import sys

    import algos
    from env_server.agents import BUILT_IN, ENVS

    own = (any(spec is not BUILT_IN.get(name) for name, spec in ENVS.items())
           or any(e.fn.__module__ != "algos" for e in algos.ESTIMATORS.values()))
    argv0 = sys.argv[0] if sys.argv else ""
    if own and argv0.endswith(".py") and os.path.basename(argv0) not in ("train.py",
                                                                         "__main__.py"):
        return shlex.quote(argv0)
    return "train.py"


def find_checkpoint(out: str) -> str | None:
    # .old survives a crash between the two renames
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            return path
    return None


def read_log(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl or eval.jsonl. A last line that does not parse is a
    write a crash cut short: dropped, with a note; a bad line before it is a ValueError naming
    it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, x) for n, x in enumerate(f, 1) if x.strip()]
    rows = []
    for k, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as e:
            if k < len(lines) - 1:
                raise ValueError(f"{path}:{n} is not JSON ({e}): mend or remove that "
                                 "line") from None
            if global_rank() == 0:
                print(f"{path}:{n}: a line cut short by a crash, dropped: "
                      f"{line.strip()[:60]}", flush=True)
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{n} is not a step's line (an object with its step): "
                             "mend or remove that line")
        rows.append(row)
    return rows


def ended_at(out: str, step: int) -> dict | None:
    """OUT/summary.json where the run ended at `step` (a run stopped in its last step has a
    checkpoint there but no summary: its final evaluation and summary are still to do)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        return summary if summary["steps"] == step else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def previous_minutes(out: str, st: dict) -> float:
    """The run's minutes before a resume from the checkpoint whose trainer state is `st`:
    those of its summary where the run ended at the checkpoint (its last save and summary
    counted), else those the checkpoint holds (0 in one saved before checkpoints held
    them)."""
    summary = ended_at(out, st["step"]) or {}
    if isinstance(summary.get("minutes"), (int, float)):
        return float(summary["minutes"])
    return float(st.get("minutes", 0.0))


def truncate_logs(out: str, last_step: int) -> None:
    """Drop what a run wrote past its checkpoint, before it was stopped: metric and evaluation
    lines (and a last line a crash cut short), and rollout logs (the resumed run plays those
    steps again)."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = os.path.join(out, name)
        if os.path.exists(path):
            rows = [r for r in read_log(path) if r["step"] <= last_step]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    folder = os.path.join(out, "rollouts")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.startswith("step_") and name[5:11].isdigit() and int(name[5:11]) > last_step:
            os.remove(os.path.join(folder, name))


# ---------------------------------------------------------------- one writer a folder
LOCK = ".lock"  # OUT/.lock: held (flock) by the process that writes the folder, while it runs


def folder_holder(out: str) -> str | None:
    """Who holds OUT's lock now ("pid N: its command"), or None: a lock whose process ended is
    free (the kernel drops a flock with its process, kill -9 included)."""
    import fcntl

    path = os.path.join(out, LOCK)
    try:
        f = open(path, encoding="utf-8")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        return None


class FolderInUse(Exception):
    """OUT's lock is held by another process; the message names it."""


def hold_folder(out: str):
    """Take OUT's lock for as long as this process lives (or until `release(handle)`): two
    runs writing one folder would interleave their metrics and overwrite each other's
    checkpoints. Raises FolderInUse naming the holder. Makes OUT if needed."""
    import fcntl
    import sys

    os.makedirs(out, exist_ok=True)
    f = open(os.path.join(out, LOCK), "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise FolderInUse(f"{out} is in use by {holder}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}: {shlex.join([os.path.basename(sys.executable), *sys.argv])}")
    f.flush()
    return f
