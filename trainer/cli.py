"""What the scripts' command lines share: a config dataclass becomes the parser, a run's
config.json can be replayed, errors are one line, and the thread count is chosen in one place.

    @dataclass
    class Config:
        lr: float = arg(3e-4, "learning rate")    # -> --lr, with its default in -h
    cfg = parse_config(Config, argv, __doc__)     # also --config FILE, which flags override
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import field

from trainer.install_check import check_install


def arg(default, help: str, group: str | None = None, **kw):
    """A config field: its default, a one-line help, the -h group it is listed in (None: the
    essential flags, listed first), and argparse extras (`choices`, which may be a function
    returning them, read when the parser is built: registries can grow after import)."""
    return field(default=default, metadata={"help": help, "group": group, **kw})


@dataclasses.dataclass
class Shared:
    """The flags train.py, eval.py and recipes/sft.py share, declared once; each script's
    config subclasses this and adds its own."""
    env: str = arg(
        "textcraft", "environment (env_server/agents.py's ENVS): textcraft, babyai, "
                     "sciworld, searchqa, webarena, corridor, doors")
    env_addr: str | None = arg(None, "URL of a running env server; absent: start one locally")
    model: str | None = arg(None, "HF model folder, hub name or built-in name (smollm2-135m, "
                                  "smollm2-135m-sft); absent: the built-in tiny model, "
                                  "warm-started")
    engine: str = arg(
        "auto", "generation engine: HF (anywhere), vLLM (in process, CPU or GPU, where it "
                "is installed), or auto: vLLM for models of 10M parameters or more where "
                "it imports and one process generates (or on CUDA), else HF",
        choices=["auto", "hf", "vllm"])
    seed: int = arg(0, "seed of task order, noise and sampling")
    temperature: float = arg(
        1.0, "sampling temperature (the paper trains and evaluates at 1)", group="generation")
    max_new_tokens: int = arg(64, "tokens per assistant turn", group="generation")
    vllm_eager: bool = arg(
        False, "vLLM: skip compiling the model (SmolLM2 on 2 cores: starts in 10 s instead "
               "of 70-90 s, decodes 20% slower)", group="generation")
    dtype: str = arg(
        "auto", "compute dtype (weights and optimizer stay fp32). auto: bf16 on CUDA and "
                "on CPUs with native bf16 (AVX-512 BF16, AMX) for models of 10M parameters "
                "or more, else fp32 (the built-in tiny model)",
        choices=["auto", "fp32", "bf16"], group="run")
    threads: int = arg(
        0, "CPU threads for torch per process (0: all cores but one while an env server "
           "works, all during an update; shared by the processes of this node). Cores "
           "shared with other runs: give each --threads 1 (cli.cpu_threads)", group="run")
    cache_dir: str = arg(os.path.expanduser("~/.cache/agentgym-rl-mini"),
                         "where built-in models are built once", group="run")
    env_max_answer_mb: float = arg(
        4.0, "MiB an env server's answer may hold (/batch: each op's); a longer one is "
             "that trajectory's env error", group="faults")


class Parser(argparse.ArgumentParser):
    """argparse with every default in -h and one-line errors (no usage block: train.py has 60
    flags)."""

    def __init__(self, **kw):
        super().__init__(formatter_class=Formatter, **kw)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (-h lists every flag)\n")
        sys.exit(2)


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; each flag's help ends with its default, unless the help
    already says what it is ("default: ...", "absent: ...") or there is none (None: the flag
    is simply not given)."""

    def _get_help_string(self, action):
        if action.default is None or any(w in (action.help or "").lower()
                                         for w in ("default", "absent")):
            return action.help
        return super()._get_help_string(action)


def _kind(f: dataclasses.Field):
    name = str(f.type).split(" ")[0].split("|")[0]
    return {"int": int, "float": float, "bool": bool}.get(name, str)


def config_parser(cls, description: str, prog: str | None = None) -> Parser:
    """A parser with one `--dashed-flag` per field of the dataclass `cls`: its type, default,
    choices and help (a `%` in a help is printed as written); bools are `--flag` /
    `--no-flag`. Plus `--config FILE`."""
    p = Parser(description=description, prog=prog,
               usage="%(prog)s [-h] [--config FILE] [--flag VALUE ...]")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a run's config.json (or any JSON object of these fields) to start "
                        "from; flags given beside it override its values")
    groups = {None: p.add_argument_group("essential flags")}
    # the essential flags (no group) first
    fields = sorted(dataclasses.fields(cls),
                    key=lambda f: f.metadata.get("group") is not None)
    for f in fields:
        flag, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        name = meta.pop("group", None)
        fresh = groups[None] if name is None else p.add_argument_group(name)
        where = groups.setdefault(name, fresh)
        helptext = meta["help"].replace("%", "%%")
        choices = meta.get("choices")
        choices = choices() if callable(choices) else choices
        if _kind(f) is bool:
            where.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=helptext)
        else:
            where.add_argument(flag, type=_kind(f), default=f.default, help=helptext,
                               choices=choices)
    return p


def given_fields(cls, argv, description: str = "", prog: str | None = None) -> set[str]:
    """The fields that the command line `argv` sets itself (not by default): parsed once more
    with every default suppressed."""
    quiet = config_parser(cls, description, prog)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv))) - {"config"}


def check_saved(p: argparse.ArgumentParser, saved: dict, flag: str) -> None:
    """Each field of a config file as its flag would take it (argparse checks what the command
    line gives, not the defaults a file sets): the flag's type (a number for a text flag is
    read as text, an int for a float one as a float), one of its choices, None only where the
    default is None; else a one-line exit naming the field."""
    for a in p._actions:
        if a.dest not in saved or not a.option_strings:
            continue
        v = saved[a.dest]
        kind = bool if isinstance(a, argparse.BooleanOptionalAction) else a.type
        if kind is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            v = saved[a.dest] = str(v)
        elif kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = saved[a.dest] = float(v)
        ok = (a.default is None if v is None
              else type(v) is kind and (a.choices is None or v in a.choices))
        if not ok:
            p.error(f"{flag}: {a.dest} = {json.dumps(v)} is not a value "
                    f"{a.option_strings[0]} takes")


def read_config(p: argparse.ArgumentParser, path: str, flag: str) -> dict:
    """A JSON object of config fields from `path`, or a one-line exit naming `flag`."""
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as e:
        p.error(f"{flag}: {e}")
    if not isinstance(saved, dict):
        p.error(f"{flag}: expected a JSON object of config fields")
    return saved


def parse_config(cls, argv=None, description: str = "", prog: str | None = None, adapt=None):
    """(parser, config) from the command line. `--config FILE` sets the defaults first, so any
    flag given beside it wins; so does OUT/config.json when the config has `resume` and `out`
    and --resume is given (a run continues with its own settings; the flags given beside
    --resume change them). A file with fields this script does not know is refused, naming
    them; with `adapt` (a function of the file's dict returning (fields, {field: why it is
    skipped})) those fields are skipped with a one-line note. `parser.given` holds the fields
    the command line set itself."""
    p = config_parser(cls, description, prog)
    args = p.parse_args(argv)
    # vision/audio builds that would break transformers: one line, before any write
    check_install()
    p.given = given_fields(cls, argv, description, prog)
    path, flag = args.config, f"--config {args.config}"
    if getattr(args, "resume", False) and args.config:
        p.error("--resume continues the run in --out with its own config.json: give changes "
                "as flags, not --config")
    if getattr(args, "resume", False) and getattr(args, "out", None):
        path, flag = (os.path.join(args.out, "config.json"),
                      f"--resume: {os.path.join(args.out, 'config.json')}")
        path = path if os.path.exists(path) else None
    if path:
        known = {f.name for f in dataclasses.fields(cls)}
        saved = read_config(p, path, flag)
        saved.pop("resume", None)  # whether to continue is the command line's to say
        skipped = {}
        if adapt is not None:
            saved, skipped = adapt(saved)
            skipped.update({k: "" for k in saved if k not in known})
            saved = {k: v for k, v in saved.items() if k in known}
        unknown = sorted(set(saved) - known)
        if unknown:
            p.error(f"{flag}: fields this script does not have: {', '.join(unknown)}")
        if skipped:
            names = ", ".join(k + (f" ({why})" if why else "")
                              for k, why in sorted(skipped.items()))
            print(f"{p.prog}: {flag}: fields {p.prog} does not use, skipped: {names}",
                  file=sys.stderr)
        check_saved(p, saved, flag)
        p.set_defaults(**saved)
        args = p.parse_args(argv)
    values = vars(args)
    values.pop("config")
    cfg = cls(**values)
    if isinstance(cfg, Shared):  # caps every env client made after (env_client.cap_answers)
        from env_client import cap_answers

        check_ranges(p, cfg, {"env_max_answer_mb": "(0, inf)", "threads": "[0, inf)"})
        if there := file_in_the_way(cfg.cache_dir):
            p.error(f"--cache-dir {cfg.cache_dir}: {there} is a file, not a folder")
        cap_answers(cfg.env_max_answer_mb)
    return p, cfg


def check_positive(p: argparse.ArgumentParser, cfg, names) -> None:
    for name in names:  # None: a default filled later
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def check_ranges(p: argparse.ArgumentParser, cfg, ranges: dict[str, str]) -> None:
    """Each named field inside its interval, written "(0, inf)", "[0, 1]"...; a None (not set)
    passes."""
    for name, interval in ranges.items():
        v = getattr(cfg, name)
        if v is None:
            continue
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        if (lo < v if interval[0] == "(" else lo <= v) and \
                (v < hi if interval[-1] == ")" else v <= hi):
            continue  # (a NaN fails both)
        if hi == float("inf") and interval[0] == "(":
            what = "positive" if lo == 0 else f"greater than {lo:g}"
        elif hi == float("inf"):
            what = "0 or more" if lo == 0 else f"at least {lo:g}"
        else:
            what = f"in {interval}"
        p.error(f"--{name.replace('_', '-')} must be {what}, got {v:g}")


def file_in_the_way(folder: str) -> str | None:
    """The file that keeps `folder` from being made (itself or a folder above it), or None."""
    there = os.path.normpath(folder)
    while not os.path.exists(there) and os.path.dirname(there) not in ("", there):
        there = os.path.dirname(there)
    return there if os.path.exists(there) and not os.path.isdir(there) else None


def unwritable(path: str) -> str | None:
    """The folder at or above `path` (a file or folder to make) that this process cannot write
    in (a read-only mount, no permission), or None: checked before a script does work that it
    could not save."""
    there = os.path.abspath(path)
    while not os.path.isdir(there):
        there = os.path.dirname(there)
    return None if os.access(there, os.W_OK | os.X_OK) else there


def check_writable(p: argparse.ArgumentParser, flag: str, path: str, what: str,
                   folder: bool = True) -> None:
    """`flag` names `path`, a folder (folder=False: a file) the script will make: one line, before
    any work it could not save, where it is empty, a file where a folder goes (a folder where a
    file goes), under a file, or in a folder this process cannot write in; `what`: what to give
    instead."""
    if not path.strip():
        p.error(f"{flag} is empty: give {what}")
    if folder and os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{flag} {path} is a file: give {what}")
    if not folder and os.path.isdir(path):
        p.error(f"{flag} {path} is a folder: give {what}")
    if there := file_in_the_way(path if folder else os.path.dirname(os.path.abspath(path))):
        p.error(f"{flag} {path}: {there} is a file, not a folder")
    if there := unwritable(path):
        p.error(f"{flag} {path}: {there} cannot be written in (read-only or no permission)")


def check_device(p: argparse.ArgumentParser, name: str) -> None:
    """--device names a device this torch has: cuda with a CPU-only build is one line, not a
    traceback."""
    import torch

    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError as e:
        p.error(f"--device {name}: {e}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            p.error(f"--device {name}: this torch ({torch.__version__}) sees no CUDA GPU; "
                    "use --device cpu")
        if device.index is not None and device.index >= count:
            p.error(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to "
                    f"cuda:{count - 1}")


def check_env(p: argparse.ArgumentParser, cfg) -> None:
    """--env names a whole registered game (agents.env_spec); a game this project does not
    serve (WebArena) needs --env-addr, and a model: the built-in tiny model only knows the
    games served here."""
    from env_server.agents import env_spec

    try:
        spec = env_spec(cfg.env)
    except ValueError as e:
        p.error(f"--env: {e}")
    if cfg.env == "sciworld" and cfg.env_addr is None:  # served here: its JVMs need Java
        from env_server.sciworld import java_problem

        if problem := java_problem():
            p.error(f"--env sciworld: {problem}")
    if spec.server is None:
        if cfg.env_addr is None:
            p.error(f"--env {cfg.env} is served by another project: give its server's "
                    "address with --env-addr")
        if all(getattr(cfg, k, None) is None for k in ("model", "checkpoint", "endpoint")):
            p.error(f"--env {cfg.env} needs --model: the built-in tiny model only knows the "
                    "envs served here")
    check_env_addr(p, cfg.env_addr, cfg.env)


def check_env_addr(p: argparse.ArgumentParser, addr: str | None,
                   env: str | None = None) -> None:
    """--env-addr answers (any answer: AgentGym's servers reply to / in plain text), before
    anything is written; a refused connection or a silent address is one line. A server that
    names its game (this project's say {"env": ...} at /) must serve `env`; one that does not
    say is taken at its word."""
    if not addr:
        return
    from env_client import EnvError, Transport

    try:
        health = Transport(addr, timeout=10.0, retries=0).request("GET", "/")
    except ValueError as e:
        p.error(f"--env-addr: {e}")
    except EnvError as e:
        if e.kind in ("connection", "timeout"):
            p.error(f"--env-addr {addr}: no env server answers there ({e.message})")
        return
    served = health.get("env") if isinstance(health, dict) else None
    if env and isinstance(served, str) and served != env:
        p.error(f"--env-addr {addr} serves {served}, not {env} (--env): point it at a "
                f"{env} server")


def check_reporter(p: argparse.ArgumentParser, kind: str) -> None:
    """--report-to names a tracker whose package is installed (report.py), before anything is
    written."""
    from trainer.report import missing

    problem = missing(kind)
    if problem:
        p.error(problem)


def check_model(p: argparse.ArgumentParser, model: str | None) -> None:
    from models.names import check_model as why_not

    problem = why_not(model)
    if problem:
        p.error(problem)


def cpu_threads(threads: int = 0, leave_one: bool = True) -> int:
    """torch's CPU threads per process: `threads` when given, else all cores (less one when
    `leave_one`: an env server on this machine needs it), shared by the processes of this node
    (torchrun's LOCAL_WORLD_SIZE).

    Cores shared with other work: OpenMP's threads wait for each other by spinning, and a
    thread whose core another process holds makes the others spin for a whole time slice, at
    every small operation (a tiny model's update ran 6x slower than on one thread). The
    scripts therefore set OMP_WAIT_POLICY=PASSIVE before torch loads (a waiting thread sleeps;
    measured with 5 busy processes on 2 cores: small products 90x faster than spinning, large
    ones no slower); an OMP_WAIT_POLICY of your own is kept. --threads 1 avoids the waiting
    altogether."""
    if threads:
        return threads
    cores = (os.cpu_count() or 2) - (1 if leave_one else 0)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def serving_env(name: str, env_addr: str | None = None):
    """(url, server) of the env server a script plays on: env_server.process.serving's
    (--env-addr, else a `python -m env_server NAME` child process). A game the script
    registered itself is unknown to that process: it is served on a thread of this one (server
    None). That imports Flask here, which vLLM's start trips on (process.py says why): with
    vLLM, serve such a game in another process (env_server.app.serve_in_thread) and give
    --env-addr."""
    from env_server.agents import registered_here
    from env_server.process import serving

    if env_addr or not registered_here(name):
        with serving(name, env_addr) as found:
            yield found
        return
    from env_server import get_env_class
    from env_server.app import serve_in_thread

    url, stop = serve_in_thread(get_env_class(name))
    if os.environ.get("RANK", "0") == "0":
        print(f"--env {name} is registered by this script, not in env_server/agents.py: "
              f"served on a thread of this process at {url}", file=sys.stderr, flush=True)
    try:
        yield url, None
    finally:
        stop()


def task_lists(url: str, env: str, tasks_file: str | None, list_split: str = "train",
               given: bool = True) -> dict:
    """env_client.task_splits, or a one-line exit: no server at the address, a bad
    --tasks-file, or (for training) task ids in both the training and the test split."""
    from env_client import EnvError
    from tasks import task_splits

    try:
        tasks = task_splits(url, env, tasks_file, list_split=list_split)
    except ValueError as e:  # a bad --tasks-file, or an address that is not an env server
        sys.exit(f"--env-addr {e}" if given and str(e).startswith(url) else str(e))
    except EnvError as e:
        where = f"--env-addr {url}" if given else f"the local {env} server at {url}"
        sys.exit(f"{where}: no env server answers there ({e.message})")
    splits = tasks["splits"]
    shared = sorted(set(splits.get("train", [])) & set(splits.get("test", [])))
    # held-out numbers would measure memory, not generalisation
    if list_split == "train" and shared:
        source = f"--tasks-file {tasks_file}" if tasks_file else url
        sys.exit(f"{source}: {len(shared)} task ids are in both the training and the test "
                 f"split (first: {shared[:5]}); give disjoint splits (a bare list in "
                 "--tasks-file is the training split, beside the server's test split)")
    return tasks
