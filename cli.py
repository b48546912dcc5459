"""What the scripts' command lines share: a config dataclass becomes the parser, a run's config.json can
be replayed, errors are one line, and the thread count is chosen in one place.

    @dataclass
    class Config:
        lr: float = arg(3e-4, "learning rate")            # -> --lr, with its default in -h
    cfg = parse_config(Config, argv, __doc__)               # also takes --config FILE (flags override it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import field


def arg(default, help: str, **kw):
    """A config field: its default, a one-line help, and argparse extras (`choices`, which may be a
    function returning them, read when the parser is built: registries can grow after import)."""
    return field(default=default, metadata={"help": help, **kw})


class Parser(argparse.ArgumentParser):
    """argparse with every default in -h and one-line errors (no usage block: train.py has 60 flags)."""

    def __init__(self, **kw):
        super().__init__(formatter_class=Formatter, **kw)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (-h lists every flag)\n")
        sys.exit(2)


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; each flag's help ends with its default."""


def _kind(f: dataclasses.Field):
    name = str(f.type).split(" ")[0].split("|")[0]
    return {"int": int, "float": float, "bool": bool}.get(name, str)


def config_parser(cls, description: str, prog: str | None = None) -> Parser:
    """A parser with one `--dashed-flag` per field of the dataclass `cls`: its type, default, choices and
    help (a `%` in a help is printed as written); bools are `--flag` / `--no-flag`. Plus `--config FILE`."""
    p = Parser(description=description, prog=prog)
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a run's config.json (or any JSON object of these fields) to start from; flags given "
                        "beside it override its values")
    for f in dataclasses.fields(cls):
        flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        helptext = meta["help"].replace("%", "%%")
        choices = meta.get("choices")
        choices = choices() if callable(choices) else choices
        if _kind(f) is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
        else:
            p.add_argument(flag, type=_kind(f), default=f.default, help=helptext, choices=choices)
    return p


def parse_config(cls, argv=None, description: str = "", prog: str | None = None):
    """(parser, config) from the command line; `--config FILE` sets the defaults first, so any flag given
    beside it wins. A file with fields this script does not know is refused, naming them."""
    p = config_parser(cls, description, prog)
    args = p.parse_args(argv)
    if args.config:
        known = {f.name: f for f in dataclasses.fields(cls)}
        try:
            with open(args.config, encoding="utf-8") as fh:
                saved = json.load(fh)
        except (OSError, ValueError) as e:
            p.error(f"--config {args.config}: {e}")
        if not isinstance(saved, dict):
            p.error(f"--config {args.config}: expected a JSON object of config fields")
        unknown = sorted(set(saved) - set(known))
        if unknown:
            p.error(f"--config {args.config}: fields this script does not have: {', '.join(unknown)}")
        p.set_defaults(**saved)
        args = p.parse_args(argv)
    values = vars(args)
    values.pop("config")
    return p, cls(**values)


def check_positive(p: argparse.ArgumentParser, cfg, names) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def check_env(p: argparse.ArgumentParser, cfg) -> None:
    """--env names a whole registered game (agents.env_spec); a game this project does not serve
    (WebArena) needs --env-addr, and a model: the built-in tiny model only knows the games served here."""
    from agents import env_spec

    try:
        spec = env_spec(cfg.env)
    except ValueError as e:
        p.error(f"--env: {e}")
    if spec.server is None:
        if cfg.env_addr is None:
            p.error(f"--env {cfg.env} is served by another project: give its server's address with --env-addr")
        if all(getattr(cfg, k, None) is None for k in ("model", "checkpoint", "endpoint")):
            p.error(f"--env {cfg.env} needs --model: the built-in tiny model only knows the envs served here")
    check_env_addr(p, cfg.env_addr)


def check_env_addr(p: argparse.ArgumentParser, addr: str | None) -> None:
    """--env-addr answers (any answer: AgentGym's servers reply to / in plain text), before anything is
    written; a refused connection or a silent address is one line."""
    if not addr:
        return
    from env_client import EnvError, Transport

    try:
        Transport(addr, timeout=10.0, retries=0).request("GET", "/")
    except ValueError as e:
        p.error(f"--env-addr: {e}")
    except EnvError as e:
        if e.kind in ("connection", "timeout"):
            p.error(f"--env-addr {addr}: no env server answers there ({e.message})")


def check_model(p: argparse.ArgumentParser, model: str | None) -> None:
    from models import check_model as why_not

    problem = why_not(model)
    if problem:
        p.error(problem)


def cpu_threads(threads: int = 0, leave_one: bool = True) -> int:
    """torch's CPU threads per process: `threads` when given, else all cores (less one when `leave_one`:
    an env server on this machine needs it), shared by the processes of this node (torchrun's
    LOCAL_WORLD_SIZE).

    Cores shared with other work: OpenMP's threads wait for each other by spinning, and a thread whose
    core another process holds makes the others spin for a whole time slice, at every small operation
    (a tiny model's update ran 6x slower than on one thread). The scripts therefore set
    OMP_WAIT_POLICY=PASSIVE before torch loads (a waiting thread sleeps; measured with 5 busy processes
    on 2 cores: small products 90x faster than spinning, large ones no slower); an OMP_WAIT_POLICY of
    your own is kept. --threads 1 avoids the waiting altogether."""
    if threads:
        return threads
    cores = (os.cpu_count() or 2) - (1 if leave_one else 0)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def task_lists(url: str, env: str, tasks_file: str | None, list_split: str = "train", given: bool = True) -> dict:
    """env_client.task_splits, or a one-line exit: no server at the address, a bad --tasks-file, or (for
    training) task ids in both the training and the test split."""
    from env_client import EnvError, task_splits

    try:
        tasks = task_splits(url, env, tasks_file, list_split=list_split)
    except ValueError as e:
        sys.exit(str(e))
    except EnvError as e:
        where = f"--env-addr {url}" if given else f"the local {env} server at {url}"
        sys.exit(f"{where}: no env server answers there ({e.message})")
    shared = sorted(set(tasks["splits"].get("train", [])) & set(tasks["splits"].get("test", [])))
    if list_split == "train" and shared:  # held-out numbers would measure memory, not generalisation
        sys.exit(f"{'--tasks-file ' + tasks_file if tasks_file else url}: {len(shared)} task ids are in both the "
                 f"training and the test split (first: {shared[:5]}); give disjoint splits (a bare list in "
                 "--tasks-file is the training split, beside the server's test split)")
    return tasks
