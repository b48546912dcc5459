"""What a server exposes: loopback only by default, bounded request bodies and instance counts, no
request text ever run as code, and a viewer that serves nothing outside its run folders."""

import ast
import glob
import json
import os
import subprocess
import sys

from conftest import ROOT, raw

import viewer
from env_server.app import ServerProcess


def listening_on(port: int) -> set[str]:
    """The local addresses of the LISTEN sockets on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


def test_env_server_binds_loopback_by_default():
    with ServerProcess("corridor") as s:
        assert s.url.startswith("http://127.0.0.1:")
        assert listening_on(s.port) == {"0100007F"}  # 127.0.0.1, little-endian hex


def test_viewer_binds_loopback_by_default(tmp_path):
    (tmp_path / "rollouts").mkdir()
    p = subprocess.Popen([sys.executable, "viewer.py", str(tmp_path), "--port", "0"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        assert listening_on(int(line.rsplit(":", 1)[1])) == {"0100007F"}
    finally:
        p.kill()
        p.wait()


def test_oversized_bodies_and_too_many_instances_are_refused():
    with ServerProcess("corridor", "--max-body-kb", "1", "--max-instances", "2") as s:
        status, e = raw(s.url, "POST", "/step", {"id": 1, "action": "x" * 5000})
        assert status == 413 and "error" in e
        assert raw(s.url, "POST", "/create", {})[0] == raw(s.url, "POST", "/create", {})[0] == 200
        status, e = raw(s.url, "POST", "/create", {})
        assert status == 503 and "--max-instances=2" in e["error"]
        assert raw(s.url, "GET", "/")[1]["instances"] == 2  # and it goes on serving


# Calls that would run text as code, or hand it to a shell or an unpickler: (module, name), None for builtins.
FORBIDDEN = {(None, "eval"), (None, "exec"), (None, "compile"), (None, "__import__"), ("os", "system"),
             ("os", "popen"), ("pickle", "loads"), ("pickle", "load"), ("yaml", "load"), ("marshal", "loads"),
             ("importlib", "import_module")}
# get_env_class imports the module of a name from its fixed ENVS table (given on the command line).
REGISTRY = os.path.join(ROOT, "env_server", "__init__.py")


def test_no_request_text_is_ever_run_as_code():
    """The code that serves requests has no eval/exec/compile, no os.system, no pickle/yaml loads and no
    shell=True: an action or a field value is data, whatever it says."""
    files = glob.glob(os.path.join(ROOT, "env_server", "*.py")) + [os.path.join(ROOT, f) for f in (
        "viewer.py", "env_client.py")]
    found = []
    for path in files:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if (owner, name) in FORBIDDEN and (path, name) != (REGISTRY, "import_module"):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {owner}.{name}")
            if any(k.arg == "shell" and getattr(k.value, "value", False) for k in node.keywords):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} shell=True")
    assert not found, found


def test_an_action_is_only_data():
    with ServerProcess("textcraft") as s:
        status, c = raw(s.url, "POST", "/create", {"data_idx": 0})
        marker = os.path.join(ROOT, "should_not_exist")
        for action in [f"__import__('os').system('touch {marker}')", f"$(touch {marker})", "{{7*7}}"]:
            status, r = raw(s.url, "POST", "/step", {"id": c["id"], "action": action})
            assert status == 200 and "49" not in r["observation"]
        assert not os.path.exists(marker)


def test_viewer_serves_nothing_outside_its_run_folders(tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"messages": [{"role": "user", "content": "TOP SECRET"}], "token_ids": [],
                                  "loss_mask": [], "logprobs": []}) + "\n")
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    os.symlink(secret, run / "rollouts" / "step_000001.jsonl")  # a link that leads out of the run
    c = viewer.create_app([str(run)]).test_client()
    for url in ["/run/0/step/1", "/run/0/step/1/traj/1", "/run/0/step/../../secret.jsonl",
                "/run/0/%2e%2e/%2e%2e/secret.jsonl", "/run/1"]:
        r = c.get(url)
        assert r.status_code == 404 and b"TOP SECRET" not in r.data, url
    assert b"TOP SECRET" not in c.get("/run/0").data


def test_viewer_follows_no_metrics_or_config_link_out_of_the_run(tmp_path):
    """metrics.jsonl, eval.jsonl and config.json linked out of the run folder are not read (the curves
    and step table would show another folder's numbers; config.json names the tokenizer to load)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 1, "success_rate": 0.12345, "max_turns": 3}) + "\n")
    (outside / "eval.jsonl").write_text(json.dumps({"step": 0, "success_rate": 0.6789, "tasks": 3}) + "\n")
    (outside / "config.json").write_text(json.dumps({"model": "/secret/model"}))
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    for name in ("metrics.jsonl", "eval.jsonl", "config.json"):
        os.symlink(outside / name, run / name)
    assert viewer.read_metrics(str(run)) == [] and viewer.read_metrics(str(run), "eval.jsonl") == []
    html = viewer.create_app([str(run)]).test_client().get("/run/0").get_data(as_text=True)
    assert "0.12345" not in html and "0.6789" not in html and "held-out success" not in html
    assert "/secret/model" not in viewer.load_tokenizer(str(run), None)[1]


def test_viewer_answers_huge_numbers_with_404_not_500(tmp_path):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "rollouts" / "step_000001.jsonl").write_text(json.dumps({"messages": []}) + "\n")
    c = viewer.create_app([str(run)]).test_client()
    for url in ["/run/0/step/1/traj/99999999999999999999", "/run/0/step/1/compare?a=1&b=99999999999999999999",
                "/run/0/step/99999999999999999999", "/run/0/step/1?page=99999999999999999999"]:
        assert c.get(url).status_code == 404, url


class RunsCode:
    """A pickle that would create a file when unpickled: a crafted trainer_state.pt."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_never_unpickles_code(tmp_path):
    import torch

    import checkpoints

    out, marker = tmp_path / "run", tmp_path / "ran"
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--steps", "1", "--schedule", "2",
                        "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--threads", "1",
                        "--eval-every", "0", "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    state = out / "checkpoint" / "trainer_state.pt"
    assert checkpoints.load_data(str(state))["step"] == 1  # the real file is plain data
    torch.save({"step": 1, "payload": RunsCode(str(marker))}, state)
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--steps", "2", "--schedule", "2",
                        "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--threads", "1",
                        "--eval-every", "0", "--out", str(out), "--resume", "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "holds more than plain data" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()  # the payload never ran
