"""The scripts beside train.py refuse bad input in one line, naming the flag or file, before they
write anything or do their work: recipes.sft's --out, eval.py's --out, --curriculum and
--compare, recipes.horizons' run folders and --out, tools.viewer's --port and --host, and
tools.plot's --out."""

import json
import os

from test_cli import one_line_refusal

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

