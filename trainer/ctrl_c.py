"""A Ctrl-C that nothing else catches (the first seconds, while torch and transformers load, before
a script's own handlers are in place) prints one line instead of a traceback; Python then exits as
a process stopped by SIGINT (130 in a shell). train.py and eval.py import this module first."""

import sys


def _one_line(kind, value, tb, default=sys.excepthook):
    if issubclass(kind, KeyboardInterrupt):
        print("Ctrl-C: stopped", file=sys.stderr, flush=True)
    else:
        default(kind, value, tb)


sys.excepthook = _one_line
