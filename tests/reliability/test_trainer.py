"""The trainer under interruption: Ctrl-C and SIGTERM save a checkpoint and exit cleanly, an
exception saves the last whole step (never half an update), --resume then continues exactly as if
nothing had happened (same stage, same data order, same samples) and reads past a log line a crash
cut short, a checkpoint write cut short never replaces the last good one, and the same seed gives
the same trajectories."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT
from test_faults import TINY, Faulty, finish, metrics, n_metrics, rollouts, start_train, wait_for

from trainer import checkpoints
from trainer import run as run_layer
import models.builtin as models

COMMON = [*TINY, "--schedule", "2,4", "--schedule-every", "2", "--algo", "ppo"]
DROP = ("time_rollout_s", "time_update_s", "tokens_per_s", "time_sync_s")


def strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in DROP}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def slow_server():
    # rollouts long enough to be interrupted in the middle
    with Faulty("--delay", "0.15") as server:
        yield server


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir, slow_server):
    """4 steps without interruption."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    code, log = finish(start_train([*COMMON, "--steps", "4", "--out", out,
                                    "--env-addr", slow_server.url], cache_dir))
    assert code == 0, log[-3000:]
    return out


def test_same_seed_same_first_step(tmp_path, cache_dir, slow_server, reference):
    out = str(tmp_path / "run")
    code, log = finish(start_train([*COMMON, "--steps", "1", "--out", out,
                                    "--env-addr", slow_server.url], cache_dir))
    assert code == 0, log[-3000:]
    assert rollouts(out, 1) == rollouts(reference, 1)  # token ids, log-probs, messages, rewards
    assert strip(metrics(out)[0]) == strip(metrics(reference)[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_rollout_saves_and_resume_continues_exactly(tmp_path, cache_dir, slow_server,
                                                                 reference, sig):
    out = str(tmp_path / "run")
    proc = start_train([*COMMON, "--steps", "4", "--out", out, "--env-addr", slow_server.url],
                       cache_dir)
    wait_for(lambda: n_metrics(out) >= 2, proc=proc)
    time.sleep(0.3)  # in step 3's rollout (at least 4 x 0.15 s of env time)
    proc.send_signal(sig)
    code, log = finish(proc)
    assert code == 128 + sig, log[-3000:]
    assert (f"interrupted ({sig.name})" in log and "checkpoint at step 2" in log
            and "Traceback" not in log)
    assert f"continue with: python train.py --resume --out {out}\n" in log
    assert torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"),
                      weights_only=False)["step"] == 2
    assert n_metrics(out) == 2 and not os.path.exists(os.path.join(out, "rollouts",
                                                                   "step_000003.jsonl"))

    # the command printed: no other flag
    code, log = finish(start_train(["--resume", "--out", out], cache_dir))
    assert code == 0, log[-3000:]
    got, want = metrics(out), metrics(reference)
    assert ([x["step"] for x in got] == [1, 2, 3, 4]
            and [x["max_turns"] for x in got] == [2, 2, 4, 4])
    assert [strip(x) for x in got] == [strip(x) for x in want]
    for step in (3, 4):
        assert rollouts(out, step) == rollouts(reference, step)


# train.py with a bug planted in one call of train.<name> (the n-th): the run's own code otherwise
CRASH = """import sys
import train
calls, real = [0], train.{name}
def planted(*a, **kw):
    calls[0] += 1
    if calls[0] == {n}:
        raise RuntimeError("a bug planted in call {n} of train.{name}")
    return real(*a, **kw)
train.{name} = planted
train.main(train.parse_args(sys.argv[1:]))
"""


def crash_train(name: str, n: int, args, cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CRASH.format(name=name, n=n), *args,
                           "--cache-dir", cache_dir], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_an_exception_saves_the_last_whole_step_and_resume_reads_past_torn_lines(
        tmp_path, cache_dir, slow_server, reference):
    """With the default flags (a checkpoint every 5 steps) an exception in step 3's rollout saves
    step 2 and says how to continue; lines a crash cut short at the end of metrics.jsonl and
    eval.jsonl are dropped with a note, and the resumed run is the unbroken one."""
    out = str(tmp_path / "run")
    r = crash_train("rollout", 3, [*COMMON, "--steps", "4", "--out", out,
                                   "--env-addr", slow_server.url], cache_dir)
    assert r.returncode == 1 and "RuntimeError: a bug planted in call 3" in r.stderr, (
        r.stderr[-3000:])
    assert (f"train.py: the last whole step saved: checkpoint at step 2 in {out}; continue with: "
            f"python train.py --resume --out {out}") in r.stderr
    assert torch.load(os.path.join(out, "checkpoint", "trainer_state.pt"),
                      weights_only=False)["step"] == 2
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "success_ra')  # a write the crash cut short
    with open(os.path.join(out, "eval.jsonl"), "w") as f:
        f.write('{"step": 0, "succ')
    code, log = finish(start_train(["--resume", "--out", out], cache_dir))
    assert code == 0, log[-3000:]
    assert (f"{out}/metrics.jsonl:3: a line cut short by a crash, dropped" in log
            and f"{out}/eval.jsonl:1: a line cut short" in log)
    got, want = metrics(out), metrics(reference)
    assert [strip(x) for x in got] == [strip(x) for x in want]
    for step in (3, 4):
        assert rollouts(out, step) == rollouts(reference, step)


def test_a_run_stopped_in_its_last_step_is_finished_by_resume(tmp_path, cache_dir):
    """A stop in the last step's update or final evaluation leaves a checkpoint at --steps and no
    summary: --resume plays the evaluation the stop cut short, as the unbroken run did, and
    writes the summary (it said "nothing to do", and the run could never end)."""
    import shutil

    done, out = tmp_path / "done", tmp_path / "run"
    code, log = finish(start_train([*TINY, "--steps", "2", "--eval-every", "2", "--eval-tasks",
                                    "4", "--eval-samples", "1", "--out", str(done)], cache_dir))
    assert code == 0, log[-3000:]
    shutil.copytree(done, out)
    os.remove(out / "summary.json")
    evals = (out / "eval.jsonl").read_text().splitlines()
    (out / "eval.jsonl").write_text("\n".join(evals[:-1]) + "\n")  # the final one, cut short
    code, log = finish(start_train(["--resume", "--out", str(out)], cache_dir))
    assert code == 0 and "nothing to do" not in log, log[-3000:]
    def rows(lines):
        return [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in lines]

    assert rows((out / "eval.jsonl").read_text().splitlines()) == rows(evals)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    code, log = finish(start_train(["--resume", "--out", str(out)], cache_dir))
    assert code == 0 and "nothing to do" in log, log[-3000:]


def test_an_exception_in_an_update_keeps_the_last_step_unless_a_weight_moved(tmp_path, cache_dir):
    """Step 2's update cut by an exception. Before its first optimizer step (here at its entry) the
    weights are step 1's, so step 1 is saved; after one (here in update_kl, which follows the
    optimizer steps) they are half updated, so nothing is (the checkpoint on disk, here none,
    stays what it was)."""
    out = str(tmp_path / "early")
    r = crash_train("update", 2, [*TINY, "--schedule", "2", "--steps", "3", "--out", out],
                    cache_dir)
    assert r.returncode == 1 and "a bug planted in call 2 of train.update" in r.stderr
    assert "train.py: the last whole step saved: checkpoint at step 1" in r.stderr, r.stderr[-3000:]
    assert checkpoints.find_checkpoint(out) is not None and n_metrics(out) == 1
    out = str(tmp_path / "late")
    r = crash_train("update_kl", 2, [*TINY, "--schedule", "2", "--steps", "3", "--out", out],
                    cache_dir)
    assert r.returncode == 1 and "a bug planted in call 2 of train.update_kl" in r.stderr
    assert ("train.py: nothing saved (it came in step 2's update, never saved half done); no "
            "checkpoint yet") in r.stderr, r.stderr[-3000:]
    assert checkpoints.find_checkpoint(out) is None and n_metrics(out) == 1


def test_a_torn_last_log_line_is_dropped_and_any_other_bad_line_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert checkpoints.read_log(str(path)) == [{"step": 1}, {"step": 2}]
    assert f"{path}:3: a line cut short by a crash, dropped" in capsys.readouterr().out
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, but cut before its newline
    checkpoints.truncate_logs(str(tmp_path), 5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'  # the next line starts on its own
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path}:2 is not JSON"):
        checkpoints.truncate_logs(str(tmp_path), 5)


def test_a_signal_waits_for_the_critical_section():
    with run_layer.Interrupts(defer_all=False) as intr:
        with pytest.raises(KeyboardInterrupt):  # outside: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        intr.signum, reached = None, False
        with pytest.raises(KeyboardInterrupt):
            with intr.critical():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached = True  # the section runs to its end ...
        assert reached and intr.signum == signal.SIGINT  # ... and the stop comes after it
        with pytest.raises(run_layer.StopNow):  # a second signal: at once
            with intr.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_deferred_mode_only_records():
    with run_layer.Interrupts(defer_all=True) as intr:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert intr.signum == signal.SIGTERM  # the loop reads it at the end of the step


def test_an_interrupted_checkpoint_never_replaces_the_good_one(tmp_path, cache_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.default_model_path("corridor", cache_dir)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters())
    out = str(tmp_path)

    def save(step):
        checkpoints.save_checkpoint(out, model, tok, None, {"policy": opt}, {"step": step})

    def step_of(ckpt):
        return torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["step"]

    save(1)
    real_save = torch.save

    def cut(obj, f, *a, **kw):  # a signal in the middle of writing the optimizer state
        if str(f).endswith("optim.pt"):
            with open(f, "wb") as fh:
                fh.write(b"half")
            raise KeyboardInterrupt
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", cut)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.setattr(torch, "save", real_save)
    assert (checkpoints.find_checkpoint(out) == os.path.join(out, "checkpoint")
            and step_of(checkpoints.find_checkpoint(out)) == 1)

    real_replace, calls = os.replace, []

    # killed after checkpoint -> checkpoint.old, before tmp -> checkpoint
    def crash_between_renames(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", crash_between_renames)
    with pytest.raises(KeyboardInterrupt):
        save(3)
    monkeypatch.setattr(os, "replace", real_replace)
    found = checkpoints.find_checkpoint(out)
    assert found == os.path.join(out, "checkpoint.old") and step_of(found) == 1
    assert checkpoints.load_checkpoint(found, model, None, {"policy": opt})["step"] == 1

    save(4)  # the next good save cleans up
    assert step_of(checkpoints.find_checkpoint(out)) == 4
    assert sorted(os.listdir(out)) == ["checkpoint"]


def test_the_checkpoint_renames_are_made_durable(tmp_path, cache_dir, monkeypatch):
    """After the swap the run folder itself is fsynced (its entries are what the renames changed),
    and so is every file and folder of the new checkpoint before it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.default_model_path("corridor", cache_dir)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    out = str(tmp_path)
    events, opened = [], {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def record_open(p, *a, **kw):
        fd = real_open(p, *a, **kw)
        opened[fd] = os.path.abspath(p)
        return fd

    monkeypatch.setattr(os, "open", record_open)
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", opened.get(fd))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.abspath(b))),
                                                     real_replace(a, b))[1])
    for step in (1, 2):
        events.clear()
        checkpoints.save_checkpoint(out, model, tok, None,
                                    {"policy": torch.optim.AdamW(model.parameters())},
                                    {"step": step})
        swap = events.index(("replace", os.path.join(out, "checkpoint")))
        assert ("fsync", os.path.abspath(out)) in events[swap + 1:], events[swap:]
        synced = {p for kind, p in events[:swap] if kind == "fsync"}
        tmp = os.path.join(out, "checkpoint.tmp")
        assert {tmp, os.path.join(tmp, "model"), os.path.join(tmp, "optim.pt")} <= synced
