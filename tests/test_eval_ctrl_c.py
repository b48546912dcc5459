"""eval.py and train.py stopped by Ctrl-C, as a user would: one line, exit 130, what is kept
named; no traceback, no half-built model folder."""

import os
import subprocess
import sys
import time

from conftest import ROOT


def interrupted(cmd: list[str], tmp_path, ready) -> tuple[int, str]:
    """Run `cmd` (its output in files: a full pipe would stall it), send it a SIGINT once
    `ready(stdout)` holds (polled: no fixed sleep), -> (exit code, stderr)."""
    import signal

    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
    try:
        t0 = time.monotonic()
        while not ready((tmp_path / "stdout").read_text()):
            assert proc.poll() is None and time.monotonic() - t0 < 300, \
                (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, (tmp_path / "stderr").read_text()


def test_ctrl_c_while_episodes_play_keeps_the_chunks_played_in_one_line(tmp_path):
    """Once a traceback; now one line naming what is kept (the ended chunks, in OUT.partial.jsonl),
    exit 130. The signal comes once the first chunk is kept, with most of the 24 still to play."""
    out = tmp_path / "r.json"
    partial = tmp_path / "r.json.partial.jsonl"
    code, err = interrupted([sys.executable, "eval.py", "--env", "corridor", "--n", "16",
                             "--batch", "8", "--max-turns", "6", "--max-new-tokens", "8",
                             "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
                             "--out", str(out)],
                            tmp_path, lambda _: partial.exists())
    assert code == 130 and "Traceback" not in err, err[-3000:]
    kept = len(partial.read_text().splitlines()) - 1
    assert kept % 8 == 0 and 8 <= kept < 192 and not out.exists()
    assert err.strip().splitlines()[-1] == (f"Ctrl-C: stopped; {kept} episodes kept in {partial}: "
                                            "the same command continues from them")


def test_ctrl_c_while_the_model_builds_is_one_line(tmp_path):
    """eval.py builds the tiny model's warm start as train.py does (minutes, once): a Ctrl-C there
    is one line, exit 130, and leaves no half-built folder."""
    cache, out = tmp_path / "cache", tmp_path / "r.json"
    code, err = interrupted([sys.executable, "eval.py", "--env", "textcraft", "--threads", "1",
                             "--cache-dir", str(cache), "--out", str(out)], tmp_path,
                            lambda stdout: "building the warm-started tiny model" in stdout)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"Ctrl-C: stopped building the tiny model in {cache} "
                                            "(the stages built stay there); nothing played")
    assert not [p for p in os.listdir(cache) if ".tmp" in p]
    assert sorted(os.listdir(tmp_path)) == ["cache", "stderr", "stdout"]  # no result, no partial


def test_ctrl_c_while_a_run_sets_up_is_one_line(tmp_path):
    """train.py between its "run folder:" line and its first step (the env server starting, the
    model loading, the env instances made): one line, exit 130, no run folder."""
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-c", "import models.builtin as b; "
                    f"b.default_model_path('corridor', {str(cache)!r})"], cwd=ROOT, check=True,
                   capture_output=True)
    code, err = interrupted([sys.executable, "train.py", "--env", "corridor", "--steps", "1",
                             "--threads", "1", "--cache-dir", str(cache),
                             "--out", str(tmp_path / "run")],
                            tmp_path, lambda stdout: "run folder:" in stdout)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("train.py: interrupted while setting up, before the "
                                            "first step")
    assert not (tmp_path / "run").exists()
