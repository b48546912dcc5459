"""The scripts beside train.py refuse bad input in one line, naming the flag or file, before they
write anything or do their work: recipes.sft's --out, eval.py's --out, --curriculum and
--compare, recipes.horizons' run folders and --out, tools.viewer's --port and --host, and
tools.plot's --out."""

import json
import os
import shutil

import pytest

from test_cli import one_line_error, one_line_refusal, run

import eval as evaluation
from recipes import sft


def test_sft_refuses_an_out_it_would_overwrite_or_cannot_write(tmp_path, read_only_dir, capsys):
    """A train.py run folder (its config.json would become the model's), a folder under a file
    or in one that cannot be written in: refused with the flags, not after training."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"env": "corridor", "steps": 2}))
    (run / "metrics.jsonl").write_text("{}\n")
    before = (run / "config.json").read_text()
    flags = ["--env", "corridor", "--tasks", "0-1", "--out"]
    parse = sft.parse_args
    one_line_refusal([*flags, str(run)], f"--out {run} holds files recipes.sft did not save",
                     capsys, parse)
    assert (run / "config.json").read_text() == before and len(os.listdir(run)) == 2
    (tmp_path / "f").write_text("")
    one_line_refusal([*flags, str(tmp_path / "f" / "m")], f"{tmp_path / 'f'} is a file", capsys,
                     parse)
    one_line_refusal([*flags, os.path.join(read_only_dir, "m")],
                     f"{read_only_dir} cannot be written in", capsys, parse)


def test_eval_refuses_an_out_or_curriculum_it_cannot_write_before_playing(
        tmp_path, read_only_dir, capsys, monkeypatch):
    """A folder, "", a folder that cannot be written in; a --curriculum under a file or naming
    the result itself (which it would replace): refused with the flags, nothing written."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    flags, parse = ["--env", "corridor", "--limit", "2", "--n", "1"], evaluation.parse_args
    (here / "d").mkdir()
    one_line_refusal([*flags, "--out", "d"], "--out d is a folder", capsys, parse)
    one_line_refusal([*flags, "--out", ""], "--out is empty", capsys, parse)
    out = os.path.join(read_only_dir, "r.json")
    one_line_refusal([*flags, "--out", out], f"{read_only_dir} cannot be written in", capsys,
                     parse)
    flags = ["--env", "corridor", "--limit", "2", "--n", "2", "--split", "train"]
    one_line_refusal([*flags, "--out", "r.json", "--curriculum", "r.json"],
                     "--curriculum r.json is a file --out r.json writes", capsys, parse)
    (here / "f").write_text("")
    one_line_refusal([*flags, "--out", "r.json", "--curriculum", "f/c.json"],
                     f"--curriculum f/c.json: {here / 'f'} is a file", capsys, parse)
    assert sorted(os.listdir(here)) == ["d", "f"] and os.listdir(read_only_dir) == []


def test_eval_compare_refuses_a_file_named_twice(tmp_path, capsys, monkeypatch):
    """A result compared with itself, or pooled twice on one side, is refused in one line."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"tasks": [{"item_id": 0, "scores": [1.0]}, {"item_id": 1, "scores": [0.0]}]}))
    for spec in ("a.json,./a.json", "a.json+a.json,b.json"):
        one_line_refusal(["--compare", spec], "are one file", capsys, evaluation.parse_args)


def test_horizons_refuses_a_broken_run_folder_or_an_out_it_cannot_write(tmp_path, read_only_dir,
                                                                         capsys):
    """A saved run whose config.json is cut short, a file where a run's folder goes, an --out
    in a folder that cannot be written in: one line each, before anything is written."""
    from recipes import horizons

    out, parse = tmp_path / "study", horizons.parse_args
    flags = ["--env", "corridor", "--arms", "2", "--steps", "1", "--out"]
    (out / "K2_s0").mkdir(parents=True)
    (out / "K2_s0" / "config.json").write_text('{"env": "corr')
    (out / "K2_s0" / "summary.json").write_text("{}")
    one_line_refusal([*flags, str(out)], f"{out / 'K2_s0' / 'config.json'} cannot be read",
                     capsys, parse)
    shutil.rmtree(out / "K2_s0")
    (out / "K2_s0").write_text("")
    one_line_refusal([*flags, str(out)], f"{out / 'K2_s0'} is a file", capsys, parse)
    assert os.listdir(out) == ["K2_s0"]
    one_line_refusal([*flags, os.path.join(read_only_dir, "s")],
                     f"{read_only_dir} cannot be written in", capsys, parse)


def test_viewer_and_env_server_refuse_a_port_or_host_they_cannot_serve_on(tmp_path):
    """A port outside 0-65535 (99999 served on another port, -1 a traceback) and an address that
    is no address: one line, not a server somewhere else or a traceback."""
    for bad, needle in [(["--port", "99999"], "--port: 99999 is outside [0, 65535]"),
                        (["--port", "-1"], "--port: -1 is outside [0, 65535]"),
                        (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1:8008")]:
        one_line_error(run(["-m", "tools.viewer", str(tmp_path), *bad], timeout=30), needle)
    one_line_error(run(["-m", "env_server", "corridor", "--host", "999.1.1.1"], timeout=30),
                   "cannot listen on 999.1.1.1:36001")


def test_plot_names_the_file_it_writes_and_refuses_an_out_it_cannot_write(
        tmp_path, read_only_dir, capsys):
    """A name without an extension gets .png, and the line says so; a folder, one under a file,
    one in a folder that cannot be written in and a bad flag: one line, no usage block."""
    from test_plot import write_run
    from tools import plot

    run_dir = str(tmp_path / "r")
    write_run(run_dir, [2, 2], "2")
    plot.main([run_dir, "--out", str(tmp_path / "noext")])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'noext'}.png\n"
    assert os.path.exists(tmp_path / "noext.png")
    (tmp_path / "f").write_text("")
    for args, needle in [(["--out", str(tmp_path)], f"--out {tmp_path} is a folder"),
                         (["--out", str(tmp_path / "f" / "c.png")], "is a file, not a folder"),
                         (["--out", os.path.join(read_only_dir, "c.png")], "cannot be written"),
                         (["--smooth", "0"], "--smooth must be at least 1")]:
        one_line_refusal([run_dir, *args], needle, capsys, plot.main)


def test_sciworld_without_java_is_one_line_naming_java_17(monkeypatch, capsys):
    """No `java` on the PATH: train.py and eval.py refuse --env sciworld in one line (before,
    the local server's JVM start gave 40 lines of traceback); the server itself says the same."""
    import shutil

    import eval as ev
    import train
    from env_server.sciworld import SciWorldEnv

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "java"
                        else real(name, *a, **k))
    for parse in (train.parse_args, ev.parse_args):
        with pytest.raises(SystemExit) as e:
            parse(["--env", "sciworld"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "needs Java 17 on the PATH" in err
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="needs Java 17 on the PATH"):
        SciWorldEnv.load_world(None)
