"""What a server exposes: loopback only by default, no cross-site or DNS-rebinding requests, bounded
request bodies and instance counts (JSON errors, whoever answers), no request text ever run as code,
and a viewer that serves nothing outside its run folders."""

import ast
import glob
import json
import os
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
from conftest import ROOT, raw
from toy_env import CounterEnv

from tools import viewer
from env_client import EnvClient
from env_server.app import ServerProcess, create_app, make_server, serve_wsgi_in_thread


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
    p = subprocess.Popen([sys.executable, "-m", "tools.viewer", str(tmp_path), "--port", "0"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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


# ---------------------------------------------------------------- cross-site requests
JSON = {"Content-Type": "application/json"}


def test_connections_that_trickle_a_header_or_send_nothing_are_closed_at_the_deadline():
    """Every connection the server allows (16 here) held by a client that sends a header line a
    byte every 0.2 s, or nothing at all: each is closed once its request is not whole 1 s after it
    began (checked every 0.2 s), and a health check gets through. waitress's idle rule alone
    never closes the trickling ones (each byte is activity) and held the others for 30 s."""
    import threading
    import time

    app = create_app(CounterEnv, None)
    url, stop = serve_wsgi_in_thread(app, connection_limit=16, request_deadline_s=1.0,
                                     cleanup_interval=0.2)
    host, port = urlsplit(url).hostname, urlsplit(url).port
    socks, done = [], threading.Event()
    try:
        for i in range(16):
            socks.append(socket.create_connection((host, port)))
            if i % 2 == 0:
                socks[-1].sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")

        def trickle():
            while not done.is_set():
                for sk in socks[::2]:
                    try:
                        sk.sendall(b"a")
                    except OSError:
                        pass
                time.sleep(0.2)

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        assert raw(url, "GET", "/")[0] == 200
        assert time.monotonic() - started < 8
        for sk in socks:  # each was closed by the server: reading gives end of stream
            sk.settimeout(5)
            try:
                assert sk.recv(1 << 16) == b""
            except ConnectionResetError:
                pass
    finally:
        done.set()
        for sk in socks:
            sk.close()
        stop()


def test_simple_cross_site_posts_are_refused(toy_server):
    """A web page can POST cross-site without the browser asking first only as text/plain, a form or
    no type at all: such a POST with a body gets a 415 and never reaches a game. One without a body
    passes (AgentGym's clients create so); a browser sends it with an Origin, refused below."""
    for headers in ({"Content-Type": "text/plain"},
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"},
                    {"Accept": "*/*"}):  # the last: no type
        status, e = raw(toy_server, "POST", "/create", "{}", headers)
        assert status == 415 and "Content-Type: application/json" in e["error"], (headers, e)
        status, e = raw(toy_server, "POST", "/create", "",
                        {**headers, "Origin": "http://evil.example"})
        assert status == 403, (headers, e)
    assert raw(toy_server, "GET", "/")[1]["instances"] == 0
    status, c = raw(toy_server, "POST", "/create", {},
                    {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and c["id"] == 0


def test_foreign_origins_are_refused(toy_server):
    own = f"http://127.0.0.1:{urlsplit(toy_server).port}"
    # another local site: another origin
    other_port = f"http://127.0.0.1:{urlsplit(toy_server).port + 1}"
    for origin in ("http://evil.example", "null", other_port, "https://127.0.0.1", "garbage"):
        for method, path, body in (("POST", "/create", {}), ("GET", "/", None)):
            status, e = raw(toy_server, method, path, body, {**JSON, "Origin": origin})
            assert status == 403 and "Origin" in e["error"], (origin, path, e)
    assert raw(toy_server, "GET", "/")[1]["instances"] == 0
    # the server's own pages
    assert raw(toy_server, "POST", "/create", {}, {**JSON, "Origin": own})[0] == 200


def test_dns_rebinding_is_refused_on_loopback(toy_server):
    """evil.example resolving to 127.0.0.1 lets a page read from "its own" origin: the Host it sends
    gives it away."""
    port = urlsplit(toy_server).port
    for host in (f"evil.example:{port}", "evil.example", "10.0.0.1",
                 f"127.0.0.1.evil.example:{port}", "[::1"):
        for method, path, body in (("GET", "/", None), ("POST", "/create", {}),
                                   ("GET", "/tasks", None)):
            status, e = raw(toy_server, method, path, body, {**JSON, "Host": host})
            assert status == 403 and "Host" in e["error"], (host, path, e)
    for host in (f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}",
                 "127.0.0.2:1"):
        assert raw(toy_server, "GET", "/", None, {"Host": host})[0] == 200, host
    assert raw(toy_server, "GET", "/")[1]["instances"] == 0


def test_a_server_bound_elsewhere_takes_any_host():
    """Bound to another address (--host), Host names cannot be known beforehand: any is accepted
    (and there is no authentication: docs/reliability.md). make_server tells the app where it is
    bound."""
    apps = [create_app(CounterEnv, host=h, idle_timeout_s=0)
            for h in ("0.0.0.0", "127.0.0.1", "0.0.0.0")]
    try:
        c = apps[0].test_client()
        assert c.get("/", headers={"Host": "gpu-node-7:36001"}).status_code == 200
        assert c.post("/create", json={}, headers={"Host": "10.1.2.3:36001"}).status_code == 200
        # still no simple POSTs
        assert c.post("/create", data="{}", content_type="text/plain").status_code == 415
        assert c.get("/", headers={"Origin": "http://evil.example"}).status_code == 403
        assert apps[1].test_client().get("/", headers={"Host": "gpu-node-7"}).status_code == 403
        # told 0.0.0.0, bound to loopback: loopback's rule
        server = make_server(apps[2], "127.0.0.1", 0)
        server.close()
        assert apps[2].test_client().get("/", headers={"Host": "gpu-node-7"}).status_code == 403
    finally:
        for app in apps:
            app.extensions["registry"].stop()


def test_viewer_refuses_cross_site_and_rebinding(tmp_path):
    (tmp_path / "rollouts").mkdir()
    c = viewer.create_app([str(tmp_path)]).test_client()
    assert c.get("/").status_code == 200
    for headers in ({"Host": "evil.example:8008"}, {"Origin": "http://evil.example"}):
        r = c.get("/run/0", headers=headers)
        assert (r.status_code == 403 and "error" in r.get_json()
                and str(tmp_path) not in r.get_data(as_text=True))
    r = c.post("/", data="x", content_type="text/plain")
    assert r.status_code == 415 and "error" in r.get_json()
    open_c = viewer.create_app([str(tmp_path)], host="0.0.0.0").test_client()
    assert open_c.get("/", headers={"Host": "gpu-node-7:8008"}).status_code == 200
    url, stop = serve_wsgi_in_thread(viewer.create_app([str(tmp_path)]))
    try:  # over HTTP as a browser under rebinding would ask
        assert raw(url, "GET", "/", None, {"Host": "evil.example"})[0] == 403
        assert raw(url, "GET", "/")[0] == 200
    finally:
        stop()


def test_own_and_agentgym_style_clients_pass(toy_server):
    c = EnvClient(toy_server)  # Content-Type application/json, Host 127.0.0.1:PORT
    assert c.reset(1) == "Reach 4." and c.step("add 4").done
    c.close()
    requests = pytest.importorskip("requests")  # AgentGym's clients: requests.post(json=...)
    r = requests.post(f"{toy_server}/create", json={"data_idx": 0}, timeout=10)
    assert r.status_code == 200 and r.json()["observation"] == "Reach 3."
    assert requests.get(f"{toy_server.replace('127.0.0.1', 'localhost')}/",
                        timeout=10).status_code == 200


# ---------------------------------------------------------------- errors waitress answers itself
def send_raw(port: int, data: bytes) -> tuple[int, bytes, bytes]:
    """Exact bytes on a fresh connection; (status, head, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # closed first: its answer is still readable
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:
            pass
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def test_errors_waitress_answers_itself_are_json(make_toy_server):
    """Past 16 x the app's body cap waitress refuses without asking the app; a request it cannot
    parse it answers itself too. Those answers are JSON as well."""
    port = urlsplit(make_toy_server(max_body_bytes=1000)).port
    cases = {
        413: b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000000000\r\n\r\n{",
        400: b"GARBAGE\r\n\r\n",
        431: b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 300_000 + b"\r\n\r\n",
        501: b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    }
    for code, data in cases.items():
        status, head, body = send_raw(port, data)
        assert (status == code
                and b"content-type: application/json" in head.lower()), (code, head, body[:200])
        assert isinstance(json.loads(body)["error"], str), (code, body[:200])
    status, head, body = send_raw(port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                        b"Connection: close\r\n\r\n")
    assert status == 200 and json.loads(body)["status"] == "ok"  # still serving


# Calls that would run text as code, or hand it to a shell or an unpickler: (module, name), None for
# builtins.
FORBIDDEN = {(None, "eval"), (None, "exec"), (None, "compile"), (None, "__import__"),
             ("os", "system"), ("os", "popen"), ("pickle", "loads"), ("pickle", "load"),
             ("yaml", "load"), ("marshal", "loads"), ("importlib", "import_module")}
# server_class imports the module of a name from its fixed ENVS table (given on the command line).
REGISTRY = os.path.join(ROOT, "env_server", "agents.py")


def test_no_request_text_is_ever_run_as_code():
    """The code that serves requests has no eval/exec/compile, no os.system, no pickle/yaml loads
    and no shell=True: an action or a field value is data, whatever it says."""
    files = glob.glob(os.path.join(ROOT, "env_server", "*.py")) + [os.path.join(ROOT, f) for f in (
        os.path.join("tools", "viewer.py"), "env_client.py")]
    found = []
    for path in files:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = (f.id if isinstance(f, ast.Name)
                    else f.attr if isinstance(f, ast.Attribute) else None)
            owner = (f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                     else None)
            if (owner, name) in FORBIDDEN and (path, name) != (REGISTRY, "import_module"):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {owner}.{name}")
            if any(k.arg == "shell" and getattr(k.value, "value", False) for k in node.keywords):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} shell=True")
    assert not found, found


def test_an_action_is_only_data():
    with ServerProcess("textcraft") as s:
        status, c = raw(s.url, "POST", "/create", {"data_idx": 0})
        marker = os.path.join(ROOT, "should_not_exist")
        for action in [f"__import__('os').system('touch {marker}')", f"$(touch {marker})",
                       "{{7*7}}"]:
            status, r = raw(s.url, "POST", "/step", {"id": c["id"], "action": action})
            assert status == 200 and "49" not in r["observation"]
        assert not os.path.exists(marker)


def test_viewer_serves_nothing_outside_its_run_folders(tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"messages": [{"role": "user", "content": "TOP SECRET"}],
                                  "token_ids": [], "loss_mask": [], "logprobs": []}) + "\n")
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
    """metrics.jsonl, eval.jsonl and config.json linked out of the run folder are not read (the
    curves and step table would show another folder's numbers; config.json names the tokenizer to
    load)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 1, "success_rate": 0.12345,
                                                       "max_turns": 3}) + "\n")
    (outside / "eval.jsonl").write_text(json.dumps({"step": 0, "success_rate": 0.6789,
                                                    "tasks": 3}) + "\n")
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
    for url in ["/run/0/step/1/traj/99999999999999999999",
                "/run/0/step/1/compare?a=1&b=99999999999999999999",
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

    from trainer import checkpoints

    out, marker = tmp_path / "run", tmp_path / "ran"
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--steps", "1",
                        "--schedule", "2", "--batch-size", "2", "--group-size", "2",
                        "--max-new-tokens", "4", "--threads", "1", "--eval-every", "0",
                        "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    state = out / "checkpoint" / "trainer_state.pt"
    assert checkpoints.load_data(str(state))["step"] == 1  # the real file is plain data
    torch.save({"step": 1, "payload": RunsCode(str(marker))}, state)
    r = subprocess.run([sys.executable, "train.py", "--env", "corridor", "--steps", "2",
                        "--schedule", "2", "--batch-size", "2", "--group-size", "2",
                        "--max-new-tokens", "4", "--threads", "1", "--eval-every", "0",
                        "--out", str(out), "--resume", "--cache-dir", str(tmp_path / "cache")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (r.returncode != 0 and "holds more than plain data" in r.stderr
            and "Traceback" not in r.stderr)
    assert not marker.exists()  # the payload never ran
