r"""The horizon study of AgentGym-RL: ScalingInter-RL (the turn horizon grows in stages) against a
fixed short and a fixed long horizon, from the same start, for the same steps, seeds and tasks.

    python -m recipes.horizons --env corridor --arms 2 8 2,4,8 --seeds 0 1 2 --steps 40 \
        --eval-every 10 --out runs/horizons -- --batch-size 8 --group-size 8 --lr 3e-3

Each arm x seed is an ordinary train.py run folder, OUT/K<arm>_s<seed> (OUT/K2-4-8_s0), run as a
subprocess with the flags after `--` unchanged; the study sets --schedule, --schedule-every (every
arm's stages share --steps equally), --steps, --seed, --eval-every, --eval-turns (default: the
largest horizon of any arm, so that every arm is measured at the same long horizon on the same
held-out tasks), --out, and, unless given, --save-every (= --eval-every: a killed run has a
checkpoint) and, on CPU with --parallel above 1, --threads (the cores shared out). Run logs go to
OUT/logs/.

Run the same command again and the study continues: a finished run (summary.json, --steps lines of
metrics.jsonl) is skipped, a killed one with a checkpoint continues with `train.py --resume --out
RUN` (its own config.json; the flags after `--` again, where they say where and how fast it runs),
and one with nothing saved starts again from scratch (its partial files removed). A saved run whose
settings differ from this command's is refused: a study compares like with like.

The paired end comparison needs each task's outcome, and train.py's eval.jsonl keeps only rates
(overall and per category). So each finished run's final checkpoint is evaluated once more by
eval.py, on the very held-out tasks of the curves (OUT/held_out_tasks.json: --eval-tasks spread over
the test split, as train.py picks them), with --eval-samples samples per task at the evaluation
horizon, into RUN/eval_end.json. Each arm with more than one horizon is then compared with each
fixed arm, task by task, seeds pooled, with tools/paired.py's 95% interval. `--save-every -1`
(no checkpoints) leaves this comparison out.

At the end: OUT/horizons.png (held-out success against step, the mean over seeds with a min-max
band, chance dashed; training success per step, mean over seeds, trailing mean over 5 steps), and
one table in OUT/horizons.md and OUT/horizons.json (with the commit the code came from).

The study holds OUT (OUT/.lock) while it runs: a second one into it is refused in one line naming
the first. A run folder that cannot be read (a trainer_state.pt cut short, a metrics line that is
not a step's) is named and skipped; the other runs go on. A begun study keeps its --steps.
"""

from __future__ import annotations

import json
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: cli.cpu_threads
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from recipes.horizons_report import end_result, report, rows, run_name
from scheduler import horizons, stage_steps
from trainer.cli import Parser, check_writable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# train.py's flags that the study sets for each run; given after `--` they are refused
STUDY_FLAGS = {"env", "schedule", "schedule_every", "steps", "seed", "out", "resume",
               "eval_every", "eval_turns"}
# config fields that say where and how fast a run goes, not what it computes: a saved run may
# differ from this command in them
WHERE = {"out", "resume", "threads", "device", "env_addr", "cache_dir", "report_to", "eval_batch",
         "env_timeout", "env_wait", "vllm_gpu_memory", "vllm_kv_tokens", "save_every"}


# ================================================================ the command line and its checks
@dataclass
class Job:
    """One arm x seed: its run folder, what is left to do (train.py, then eval.py), and what the
    progress lines have shown of it."""
    arm: str
    seed: int
    out: str
    index: int
    commands: list = field(default_factory=list)  # (what, argv) to run in order
    last_step: int = 0  # the last step whose metrics line was shown
    last_eval: int = -1
    proc: subprocess.Popen | None = None
    log: object = None  # the open log file of the command running
    gpu: str | None = None
    started: float = 0.0

    @property
    def name(self) -> str:
        return os.path.basename(self.out)


def flag_names(flags: list[str]) -> set[str]:
    """The config fields a list of train.py flags gives (--lr 1e-3, --lr=1e-3, --no-resume)."""
    names = set()
    for tok in flags:
        if tok.startswith("--") and len(tok) > 2:
            name = tok[2:].split("=", 1)[0].replace("-", "_")
            names.add(name)
            names.add(name.removeprefix("no_"))
    return names


def without_config(flags: list[str]) -> list[str]:
    """The flags less --config FILE: --resume reads the run's own config.json and refuses one."""
    out, skip = [], False
    for tok in flags:
        if skip:
            skip = False
        elif tok == "--config":
            skip = True
        elif not tok.startswith("--config="):
            out.append(tok)
    return out


def parse_args(argv=None):
    """The study's flags (before `--`) and train.py's (after), every one checked, each run's whole
    train.py command line checked by train.py's own parser, and every saved run's settings checked
    against this command, before anything is written. A bad flag is one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, flags = argv[:cut], argv[cut + 1:]
    p = Parser(prog="python -m recipes.horizons", description=__doc__,
               usage="%(prog)s [-h] --env ENV --arms K [K ...] [--flag VALUE ...] [-- TRAIN FLAGS]")
    p.add_argument("--env", required=True, help="environment, as train.py's --env")
    p.add_argument("--arms", nargs="+", required=True,
                   help="one horizon schedule per arm, as train.py's --schedule: '5' fixed, "
                        "'5,10,20' ScalingInter-RL")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per arm per seed")
    p.add_argument("--steps", type=int, default=30, help="training steps of every run")
    p.add_argument("--eval-every", type=int, default=10,
                   help="held-out evaluation every E steps (and before the first, after the last)")
    p.add_argument("--eval-turns", type=int, default=None,
                   help="horizon of every held-out evaluation (default: the largest of any arm)")
    p.add_argument("--out", default=os.path.join("runs", "horizons"), help="the study's folder")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs at once (default: 1 on CPU, one per GPU on CUDA; with several GPUs "
                        "the runs are spread over them with CUDA_VISIBLE_DEVICES)")
    a = p.parse_args(own)
    for arm in a.arms:
        try:
            horizons(arm)
        except ValueError as e:
            p.error(f"--arms {arm}: {e}")
    names = [run_name(arm, 0) for arm in a.arms]
    if len(set(names)) < len(names):
        p.error(f"--arms {' '.join(a.arms)}: an arm is given twice")
    if len(set(a.seeds)) < len(a.seeds) or min(a.seeds) < 0:
        p.error(f"--seeds {' '.join(map(str, a.seeds))}: give distinct seeds of 0 or more")
    for name in ("steps", "eval_every", "eval_turns", "parallel"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    mine = sorted(flag_names(flags) & STUDY_FLAGS)
    if mine:
        p.error(f"--{mine[0].replace('_', '-')} is the study's to set for each run: give it "
                "before `--`, or leave it out")
    check_out(p, a.out, [run_name(arm, seed) for seed in a.seeds for arm in a.arms])
    from trainer.checkpoints import folder_holder

    if holder := folder_holder(a.out):  # a study running there would lose runs to this one
        p.error(f"--out {a.out} is in use by {holder}: wait for it to end, or give another "
                "--out")
    from trainer.config import parse_args as train_args  # train.py's parser (imports torch)

    a.eval_turns = a.eval_turns or max(k for arm in a.arms for k in horizons(arm))
    a.out, a.flags, given = os.path.abspath(a.out), flags, flag_names(flags)
    a.added = [] if "save_every" in given else ["--save-every", str(a.eval_every)]
    cfg = train_args(run_argv(a, a.arms[0], a.seeds[0], out=None))  # train.py's checks
    a.gpus = gpus(cfg.device)
    a.parallel = a.parallel or max(1, len(a.gpus))
    if not a.gpus and a.parallel > 1 and "threads" not in given:  # CPU: the cores shared out
        a.added += ["--threads", str(max(1, (os.cpu_count() or 1) // a.parallel))]
    a.model, a.device = cfg.model, device_name(a.gpus)
    a.jobs = []
    for seed in a.seeds:
        for arm in a.arms:
            cfg = train_args(run_argv(a, arm, seed, out=None))
            job = Job(arm, seed, os.path.join(a.out, run_name(arm, seed)), len(a.jobs) + 1)
            if saved_run(job.out) and not damaged(job.out):  # a damaged one is skipped
                check_saved(p, job.out, asdict(cfg))
            a.jobs.append(job)
    a.cfg = cfg  # the settings every run shares (its seed and schedule aside)
    return a


def check_out(p, out: str, runs: list[str]) -> None:
    """--out a folder the study can make and write in, its run folders and logs/ folders where
    they are there (not files), its held_out_tasks.json not a folder; else one line, naming it."""
    check_writable(p, "--out", out, "the study's folder")
    for name in [*runs, "logs"]:
        if os.path.lexists(path := os.path.join(out, name)) and not os.path.isdir(path):
            p.error(f"--out {out}: {path} is a file where the study's {name} folder goes: move "
                    "it, or give another --out")
    if os.path.isdir(path := os.path.join(out, "held_out_tasks.json")):
        p.error(f"--out {out}: {path} is a folder where the study writes its held-out tasks: "
                "move it, or give another --out")


def run_argv(a, arm: str, seed: int, out: str | None) -> list[str]:
    """train.py's flags for one fresh run of the study."""
    every = stage_steps(arm, a.steps)  # each arm's stages share --steps equally
    return ["--env", a.env, "--schedule", arm, "--schedule-every", str(every),
            "--steps", str(a.steps), "--seed", str(seed), "--eval-every", str(a.eval_every),
            "--eval-turns", str(a.eval_turns), *a.flags, *a.added,
            *(["--out", out] if out else [])]


def saved_run(out: str) -> bool:
    """Whether `out` holds a run the study keeps (finished, or with a checkpoint to resume)."""
    from trainer.checkpoints import find_checkpoint

    return os.path.exists(os.path.join(out, "config.json")) and (
        find_checkpoint(out) is not None or os.path.exists(os.path.join(out, "summary.json")))


def check_saved(p, out: str, fresh: dict) -> None:
    """A saved run's config.json against the config this command would give it: any field that
    changes the numbers (not WHERE) differing is refused, naming it."""
    path = os.path.join(out, "config.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"--out: {path} cannot be read ({e}): remove that run folder to train it again")
    if not isinstance(saved, dict):
        p.error(f"--out: {path} is not a run's config (a JSON object): remove that run folder "
                "to train it again")
    if "steps" in saved and saved["steps"] != fresh["steps"]:
        p.error(f"--steps {fresh['steps']}: {out} was run for {saved.get('steps')} steps; a "
                "study cannot change its length once begun (a staged arm spreads its stages "
                "over --steps, so more steps would move its stages mid-run): give the study's "
                "own --steps, or another --out for the longer study")
    for name in sorted(set(fresh) - WHERE):
        if name in saved and saved[name] != fresh[name]:
            p.error(f"--out: {out} was run with {name} = {json.dumps(saved[name])}, this command "
                    f"gives {json.dumps(fresh[name])}: give the study's own flags, or another "
                    "--out")


def gpus(device: str) -> list[str]:
    """The GPUs runs may be spread over (CUDA_VISIBLE_DEVICES where set); none on CPU."""
    if device == "cpu":
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [x.strip() for x in visible.split(",") if x.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def device_name(ids: list[str]) -> str:
    if not ids:
        return f"CPU ({os.cpu_count()} cores)"
    import torch

    return f"{len(ids)} x {torch.cuda.get_device_name(0)}"


# ================================================================ what each run has left to do
def damaged(out: str) -> str | None:
    """What makes a run folder unreadable, in a few words (a trainer_state.pt cut short, a
    metrics or eval line that is not a step's), or None. Such a run is reported and skipped;
    the others go on."""
    from trainer.checkpoints import find_checkpoint, load_data

    for name in ("metrics.jsonl", "eval.jsonl"):
        try:
            for r in rows(os.path.join(out, name)):
                if not isinstance(r, dict) or type(r.get("step")) is not int:
                    return f"{name} has a line that is not a step's: {json.dumps(r)[:80]}"
        except (OSError, ValueError) as e:
            return f"{name} cannot be read ({e})"
    ckpt = find_checkpoint(out)
    if ckpt:
        try:
            step = load_data(os.path.join(ckpt, "trainer_state.pt"))["step"]
            if type(step) is not int:
                raise ValueError(f"its step is {step!r}")
        except ValueError as e:  # load_data's: it names the file and what torch said
            return str(e).split(". ")[0]
        except Exception as e:  # torch.load's errors on a cut file have no common type
            return f"{ckpt}/trainer_state.pt cannot be read ({type(e).__name__})"
    return None


def finished(out: str, steps: int) -> bool:
    return (os.path.exists(os.path.join(out, "summary.json"))
            and len(rows(os.path.join(out, "metrics.jsonl"))) == steps)


def plan(a, job: Job, held_out: str) -> str:
    """Fill job.commands with what the run still needs; returns what it is, for the progress
    line. A run with nothing to resume from is removed first, as train.py refuses a folder that
    holds metrics without a checkpoint."""
    from trainer.checkpoints import find_checkpoint, load_data

    py, ckpt = sys.executable, find_checkpoint(job.out)
    if finished(job.out, a.steps):
        what, job.last_step, job.last_eval = "finished", a.steps, a.steps
    elif ckpt:
        step = load_data(os.path.join(ckpt, "trainer_state.pt"))["step"]
        # lines past the checkpoint are dropped and played again: shown once they are passed
        logged = [r["step"] for name in ("metrics.jsonl", "eval.jsonl")
                  for r in rows(os.path.join(job.out, name))]
        job.last_step = job.last_eval = max([step, *logged])
        job.commands.append(("train", [py, "train.py", "--resume", "--out", job.out,
                                       *without_config(a.flags), *a.added]))
        what = f"resuming from its checkpoint at step {step}"
    else:
        what = "training from scratch"
        if os.path.exists(job.out):
            shutil.rmtree(job.out)
            what += " (nothing saved to resume from: its partial files removed)"
        job.commands.append(("train", [py, "train.py", *run_argv(a, job.arm, job.seed, job.out)]))
    # the end evaluation plays the final checkpoint: one that is there or will be
    if (job.commands or ckpt) and held_out and a.cfg.save_every != -1 \
            and end_result(job.out) is None:
        c = a.cfg
        job.commands.append(("evaluate", [
            py, "eval.py", "--checkpoint", job.out, "--split", "test", "--tasks-file", held_out,
            "--n", str(c.eval_samples), "--max-turns", str(a.eval_turns), "--seed", str(job.seed),
            "--batch", str(c.eval_batch), "--threads", str(c.threads), "--device", c.device,
            "--engine", c.engine, "--dtype", c.dtype, "--cache-dir", c.cache_dir,
            *(["--env-addr", c.env_addr] if c.env_addr else []),
            *(["--vllm-eager"] if c.vllm_eager else []),
            "--out", os.path.join(job.out, "eval_end.json"),
            "--overwrite"]))  # one there is unreadable (end_result): played again
    return what if job.commands else "finished, skipped"


def held_out_tasks(a) -> str:
    """OUT/held_out_tasks.json: the test tasks train.py evaluates on (--eval-tasks spread over the
    test split, tasks.spread), for eval.py's --tasks-file; '' when the split is empty."""
    from env_server.process import serving
    from trainer.cli import task_lists
    from tasks import spread

    c, path = a.cfg, os.path.join(a.out, "held_out_tasks.json")
    with serving(c.env, c.env_addr) as (url, _):
        listed = task_lists(url, c.env, c.tasks_file, given=c.env_addr is not None)
    ids = spread(listed["splits"].get("test", []), c.eval_tasks)
    if not ids:
        return ""
    cats = {str(i): name for i, name in listed["categories"].items() if i in ids}
    with open(path, "w") as f:
        json.dump({"test": ids, **({"categories": cats} if cats else {})}, f)
    return path


# ================================================================ running them
class Study:
    """Runs the jobs, --parallel at a time (each command in its own session, so that a signal to
    the study reaches every run once: train.py saves a checkpoint on the first SIGTERM and stops
    at once on a second), and prints a line per run and per finished step."""

    def __init__(self, a, jobs: list[Job]):
        self.a, self.jobs, self.running, self.failed = a, jobs, [], []
        self.t0, self.signum = time.time(), None
        self.done_at_start = sum(j.last_step for j in a.jobs)
        os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)

    def say(self, job: Job, text: str) -> None:
        print(f"[{job.index}/{len(self.a.jobs)}] {job.name}: {text}", flush=True)

    def left(self) -> str:
        """The steps done of all runs, and the time left at this invocation's pace so far."""
        total = len(self.a.jobs) * self.a.steps
        done = sum(j.last_step for j in self.a.jobs)
        rate = (done - self.done_at_start) / max(1e-9, time.time() - self.t0)  # steps per s
        eta = f", about {(total - done) / rate / 60:.1f} min left" if rate > 0 else ""
        return f"study {done}/{total} steps{eta}"

    def start(self, job: Job) -> None:
        what, cmd = job.commands.pop(0)
        if job.gpu is None and self.a.gpus:  # the least busy GPU; the job keeps it
            load = {g: sum(j.gpu == g for j in self.running) for g in self.a.gpus}
            job.gpu = min(self.a.gpus, key=lambda g: (load[g], self.a.gpus.index(g)))
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": job.gpu} if len(self.a.gpus) > 1
                                else {})}
        job.log = open(os.path.join(self.a.out, "logs", job.name + ".log"), "a")
        job.log.write(f"\n$ {shlex.join(cmd[1:])}\n")
        job.log.flush()
        job.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=job.log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        job.started = job.started or time.time()
        if self.signum is not None:  # a signal came while it started
            job.proc.send_signal(signal.SIGTERM)
        if what == "evaluate":
            self.say(job, f"evaluating the final checkpoint on the held-out tasks (eval.py, "
                          f"K={self.a.eval_turns})")

    def watch(self, job: Job) -> None:
        """Lines for the steps and evaluations the run has logged since the last look, in order."""
        lines = []
        for r in rows(os.path.join(job.out, "metrics.jsonl")):
            if r["step"] > job.last_step:
                job.last_step = r["step"]
                lines.append((r["step"], 0, f"step {r['step']}/{self.a.steps}, K={r['max_turns']}, "
                                            f"training success {r['success_rate']:.3f}"))
        for e in rows(os.path.join(job.out, "eval.jsonl")):
            if e["step"] > job.last_eval:
                job.last_eval = e["step"]
                lines.append((e["step"], 1, f"held-out success after step {e['step']}: "
                                            f"{e['success_rate']:.3f} ({e['tasks']} tasks x "
                                            f"{e.get('samples', 1)}, K={e['max_turns']})"))
        for _, _, text in sorted(lines):
            self.say(job, f"{text}; {self.left()}")

    def on_signal(self, signum, frame) -> None:
        self.signum = signum  # no new run starts; the running ones get it once more each time
        for job in [j for j in self.running if j.proc is not None]:
            job.proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def run(self) -> None:
        before = {s: signal.signal(s, self.on_signal)
                  for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self.loop()
        finally:  # a caller in the same process (bench/horizons.py, a test) gets its own back
            for s, handler in before.items():
                signal.signal(s, handler)
        if self.signum is not None:
            print(f"stopped ({signal.Signals(self.signum).name}); the same command continues the "
                  "study", flush=True)
            sys.exit(128 + self.signum)

    def loop(self) -> None:
        pending = list(self.jobs)
        while pending or self.running:
            while pending and len(self.running) < self.a.parallel and self.signum is None:
                job = pending.pop(0)
                self.running.append(job)
                self.start(job)
            if self.signum is not None:
                pending = []
            time.sleep(0.5)
            for job in list(self.running):
                self.watch(job)
                rc = job.proc.poll()
                if rc is None:
                    continue
                job.log.close()
                if rc == 0 and job.commands and self.signum is None:
                    self.start(job)  # its evaluation, on the same GPU
                    continue
                self.running.remove(job)
                if rc and self.signum is not None:
                    self.say(job, f"stopped (exit {rc})")
                elif rc:
                    self.failed.append(job)
                    self.say(job, f"failed (exit {rc}); its log: "
                                  f"{os.path.join(self.a.out, 'logs', job.name + '.log')}")
                else:
                    self.say(job, f"done in {(time.time() - job.started) / 60:.1f} min; "
                                  f"{self.left()}")


def main(argv=None) -> dict | None:
    from trainer.checkpoints import FolderInUse, hold_folder

    a = parse_args(argv)
    try:  # the first write, every check passed: the study's folder is this process's
        lock = hold_folder(a.out)  # noqa: F841  held while this process lives
    except FolderInUse as e:
        sys.exit(f"python -m recipes.horizons: --out {e}: wait for it to end, or give "
                 "another --out")
    a.damaged = []
    # the end evaluations' tasks, written again whenever one is to be played
    ends = a.cfg.save_every != -1 and any(end_result(j.out) is None for j in a.jobs)
    held_out = held_out_tasks(a) if ends else ""
    todo = []
    for job in a.jobs:
        if problem := damaged(job.out):
            a.damaged.append(job.name)
            print(f"[{job.index}/{len(a.jobs)}] {job.name}: damaged, skipped: {problem}; "
                  "remove that folder to train it again", flush=True)
            continue
        what = plan(a, job, held_out)
        print(f"[{job.index}/{len(a.jobs)}] {job.name}: {what}", flush=True)
        if job.commands:
            todo.append(job)
    print(f"{len(todo)} of {len(a.jobs)} runs to do, {a.parallel} at once on {a.device}; logs in "
          f"{os.path.join(a.out, 'logs')}", flush=True)
    study = Study(a, todo)
    study.run()
    if study.failed:
        sys.exit(f"{len(study.failed)} run(s) failed: {', '.join(j.name for j in study.failed)}; "
                 "fix the cause (see its log) and run the same command again to continue")
    return report(a)


if __name__ == "__main__":
    main()
