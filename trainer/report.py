"""Experiment tracking beside the run folder's own logs: `--report-to none|tensorboard|wandb`.

    reporter = make_reporter("tensorboard", out, config)  # OUT/tensorboard/ (event files)
    reporter.log("train", row, step)      # every number of a metrics.jsonl line
    reporter.log("eval", result, step)    # a held-out evaluation (by_category flattened)
    reporter.close()

TensorBoard and Weights & Biases are optional packages, imported only when asked for;
`missing` names the one that is not installed, so that the scripts refuse the flag at parse
time, before anything is written. W&B runs offline with WANDB_MODE=offline (its files go to
OUT/wandb/; `wandb sync` uploads them later). The config goes in as W&B's run config, and as a
text entry "config" in TensorBoard.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os

from packaging.version import Version  # wandb's version against WANDB_MIN (PEP 440)

REPORTERS = ("none", "tensorboard", "wandb")
# --report-to value -> the package it needs
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# wandb.init(reinit="create_new"): one run per reporter, not one a process
WANDB_MIN = "0.19.10"


def missing(kind: str) -> str | None:
    """Why `--report-to kind` cannot run here (its package is not installed; W&B online
    without a login), or None."""
    package = PACKAGES.get(kind)
    try:
        found = package is None or importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (f"--report-to {kind} needs the {package} package, which is not installed: "
                f"pip install {package}")
    version = _version(package) if kind == "wandb" else None
    if version is not None and Version(version) < Version(WANDB_MIN):
        return (f"--report-to wandb needs wandb {WANDB_MIN} or newer "
                f"(reinit=\"create_new\"), not {version}: pip install -U wandb")
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
    if (kind == "wandb" and not offline and not os.environ.get("WANDB_API_KEY")
            and not _netrc_login()):
        return ("--report-to wandb: no W&B login (WANDB_API_KEY or `wandb login`); "
                "WANDB_MODE=offline logs into the run folder without one")
    return None


def _version(package: str) -> str | None:
    """The installed distribution's version; None for a package importable without one."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _netrc_login() -> bool:
    """Whether ~/.netrc holds a login for the W&B host (where `wandb login` puts it)."""
    import netrc
    from urllib.parse import urlsplit

    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return bool(netrc.netrc().authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def numbers(row: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a log line, nested dicts flattened as "a/b"; bools as 0/1, text
    left out."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[prefix + k] = float(v)
    return out


class Reporter:
    """--report-to none: every call does nothing."""

    def log(self, section: str, row: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard(Reporter):
    def __init__(self, out: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(out, "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, section: str, row: dict, step: int) -> None:
        for k, v in numbers(row).items():
            self.writer.add_scalar(f"{section}/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Reporter):
    def __init__(self, out: str, config: dict, project: str):
        import wandb

        self.run = wandb.init(project=project, name=os.path.basename(os.path.normpath(out)),
                              dir=out, config=config, reinit="create_new")

    def log(self, section: str, row: dict, step: int) -> None:
        self.run.log({f"{section}/{k}": v for k, v in numbers(row).items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def make_reporter(kind: str, out: str, config: dict,
                  project: str = "agentgym-rl-mini") -> Reporter:
    if kind == "tensorboard":
        return TensorBoard(out, config)
    if kind == "wandb":
        return WandB(out, config, project)
    return Reporter()
