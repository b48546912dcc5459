"""The env server as a child process of a script: `ServerProcess` and `serving`.

Kept apart from app.py so that the scripts (train.py, eval.py, recipes/sft.py) never import Flask:
their process holds the model and the generation engine, and vLLM's worker, while it starts, reads
an attribute of every global of every loaded module, which Flask's request proxies refuse outside a
request.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading


class ServerProcess:
    """`python -m env_server NAME` in a child process, on a free port; `.url`, `.stop()`,
    `.restart()`.

    Used by train.py when no `--env-addr` is given, and by tests and benches. A separate process
    keeps the env off the trainer's GIL. It runs in its own session, so a Ctrl-C meant for the
    trainer does not kill it mid-step (the trainer stops it), and it exits by itself if the trainer
    dies.
    """

    def __init__(self, name: str, *args: str, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 60.0, env: dict | None = None):
        self.name, self.args, self.host, self.env = name, args, host, env
        self.start_timeout_s = start_timeout_s
        self._launch(port)

    def _launch(self, port: int) -> None:
        cmd = [sys.executable, "-m", "env_server", self.name, "--host", self.host, "--port",
               str(port), "--parent-pid", str(os.getpid()), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env,
                                     cwd=os.path.dirname(
                                         os.path.dirname(os.path.abspath(__file__))),
                                     start_new_session=True)
        self.stderr_tail: list[str] = []
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put("")],
                         daemon=True).start()
        # Keep the last lines of stderr for error messages; reading also keeps the pipe from
        # filling.
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        try:
            line = lines.get(timeout=self.start_timeout_s)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"env server {self.name!r} did not start within "
                               f"{self.start_timeout_s:g} s") from None
        if not line.startswith("serving "):
            self.proc.wait(10)
            raise RuntimeError(f"env server {self.name!r} exited with code "
                               f"{self.proc.returncode}:\n"
                               + "".join(self.stderr_tail[-30:]))
        self.url = line.split(" on ", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        """Start it again on the same port (its clients' address stays valid)."""
        self.stop()
        self._launch(self.port)

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line])[-200:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@contextlib.contextmanager
def serving(name: str, env_addr: str | None = None, **kw):
    """(url, server) of the env server a script plays on: `env_addr` as given (server None), else a
    local `python -m env_server NAME` (a ServerProcess, `kw` its options) started for the
    duration."""
    if env_addr:
        yield env_addr, None
        return
    server = ServerProcess(name, **kw)
    try:
        yield server.url, server
    finally:
        server.stop()

