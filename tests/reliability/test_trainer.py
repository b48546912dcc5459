"""The trainer under interruption: Ctrl-C and SIGTERM save a checkpoint and exit cleanly, --resume
then continues exactly as if nothing had happened (same stage, same data order, same samples), a
checkpoint write cut short never replaces the last good one, and the same seed gives the same
trajectories."""

import os
import signal
import time

import pytest
import torch
from test_faults import TINY, Faulty, finish, metrics, n_metrics, rollouts, start_train, wait_for

from trainer import checkpoints
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


def test_a_signal_waits_for_the_critical_section():
    with checkpoints.Interrupts(defer_all=False) as intr:
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
        with pytest.raises(checkpoints.StopNow):  # a second signal: at once
            with intr.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_deferred_mode_only_records():
    with checkpoints.Interrupts(defer_all=True) as intr:
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
