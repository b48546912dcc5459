"""A hurried user's train.py command is refused in one line before anything is written, or
warned of: an --out that is empty or cannot be written in, and the other cases below."""

import os

from test_cli import one_line_refusal


def test_an_out_that_is_empty_or_cannot_be_written_is_refused_first(read_only_dir, capsys):
    """Refused with the flags, not after the models load (a traceback then, or after SFT's
    whole training)."""
    one_line_refusal(["--env", "corridor", "--out", ""], "--out is empty", capsys)
    out = os.path.join(read_only_dir, "run")
    one_line_refusal(["--env", "corridor", "--out", out],
                     f"--out {out}: {read_only_dir} cannot be written in", capsys)
    assert os.listdir(read_only_dir) == []
