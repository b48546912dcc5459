"""An OpenAI-compatible chat endpoint as eval.py's policy (`--endpoint URL --endpoint-model NAME`).

`ChatEndpoint` posts a rollout's messages to URL/chat/completions and returns the reply text,
retrying failed requests; `ChatPolicy` is the policy rollout.rollout plays: it asks the endpoint for
every active trajectory at once. A request that still fails is that trajectory's error (status
env_error, counted as an endpoint error), never a reply and never a score of 0; so is an answer
past the bounds (--endpoint-timeout-s in all, --endpoint-max-answer-kb, no redirects). A request
past --endpoint-max-context-kb (the whole dialogue, sent each turn) is not sent: the episode ends
as context_limit, as a local engine's at --max-context.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from env_client import EnvError
from rollout import Reply, Trajectory

ENDPOINT_ERROR = "endpoint"  # the EnvError kind of a failed chat request: Trajectory.error's prefix
# A reply of a few thousand tokens is tens of KB of JSON; far more is an endpoint gone wrong.
MAX_ANSWER_BYTES = 512 * 1024
# A request holds the whole dialogue: 2 MB is some 500K tokens, past the context of most models.
MAX_REQUEST_BYTES = 2048 * 1024


def policy(cfg) -> ChatPolicy:
    """The policy eval.py's --endpoint flags describe."""
    chat = ChatEndpoint(cfg.endpoint, cfg.endpoint_model, cfg.temperature, cfg.top_p,
                        cfg.max_new_tokens, cfg.endpoint_timeout_s, cfg.endpoint_retries,
                        cfg.endpoint_max_answer_kb * 1024, cfg.endpoint_max_context_kb * 1024)
    return ChatPolicy(chat, cfg.endpoint_workers)


def address_error(url: str) -> str | None:
    """Why eval.py's --endpoint is not an address to post to, or None."""
    u = urllib.parse.urlsplit(url)
    try:
        u.port  # (raises on a port that is no number, or out of range)
    except ValueError as e:
        return f"bad endpoint address {url!r}: {e}"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"bad endpoint address {url!r}; expected http(s)://HOST:PORT/v1"
    return None


def name(cfg) -> str:
    """The policy's name in eval.py's result ("policy")."""
    return f"endpoint {cfg.endpoint} ({cfg.endpoint_model})"


def is_endpoint_error(t: Trajectory) -> bool:
    """Whether the trajectory ended in a failed chat request (not a failure of the env server)."""
    return t.status == "env_error" and (t.error or "").startswith(f"[{ENDPOINT_ERROR}")


class ChatEndpoint:
    """POST {base}/chat/completions with the rollout's messages; returns the reply text.

    Failures (connection, deadline, HTTP error, a redirect, an answer over `max_answer_bytes`, a
    malformed answer) raise EnvError("endpoint", ...) after `retries` extra attempts: a chat
    request does not change the game, so a retry is safe. What comes back is bounded, since the
    endpoint may be anyone's: each attempt ends within `timeout_s` in all, however slowly the
    answer trickles in (a timer shuts the socket down; a socket timeout only bounds each read); a
    redirect is not followed (it would send the dialogue elsewhere); at most `max_answer_bytes` are
    read. A request over `max_request_bytes` raises ContextFull, unsent.
    """

    def __init__(self, base_url: str, model: str, temperature: float, top_p: float, max_tokens: int,
                 timeout_s: float = 120.0, retries: int = 2,
                 max_answer_bytes: int = MAX_ANSWER_BYTES,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.url = base_url.rstrip("/") + "/chat/completions"
        if wrong := address_error(base_url):
            raise ValueError(wrong)
        self.parts = urllib.parse.urlsplit(self.url)
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.max_tokens, self.max_answer_bytes = max_tokens, max_answer_bytes
        self.max_request_bytes = max_request_bytes
        self.timeout_s, self.retries = timeout_s, retries

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "top_p": self.top_p,
                           "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
        if len(body) > self.max_request_bytes:
            raise ContextFull(f"a request of {len(body)} bytes (--endpoint-max-context-kb)")
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
            try:
                status, data = self._post(body)
            except _NoAnswer as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: {e}")
                continue
            if not 200 <= status < 300:
                what = "a redirect, not followed" if 300 <= status < 400 else repr(data[:200])
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: HTTP {status}: {what}", status)
                if status < 500 and status != 429:  # a 3xx or 4xx (but rate limiting) stays so
                    break
                continue
            try:
                content = json.loads(data)["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"content is {type(content).__name__}")
                return content
            except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
                # RecursionError: JSON nested deeper than the parser's stack ("[" x 100000)
                why = f"{type(e).__name__}: {str(e)[:200]}"
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: malformed answer ({why})")
        raise last

    def _post(self, body: bytes) -> tuple[int, bytes]:
        """One attempt, within timeout_s in all: (status, body; at most 200 bytes of an error's)."""
        deadline = time.monotonic() + self.timeout_s
        cls = http.client.HTTPSConnection if self.parts.scheme == "https" else \
            http.client.HTTPConnection
        conn = cls(self.parts.hostname, self.parts.port, timeout=self.timeout_s)
        path = self.parts.path + (f"?{self.parts.query}" if self.parts.query else "")
        try:
            conn.connect()  # bounded by the socket timeout; the timer needs the socket
            # a shut-down socket ends the read waiting on it: the deadline holds for the answer
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (conn.sock,))
            timer.start()
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                ok = 200 <= resp.status < 300
                data = resp.read(self.max_answer_bytes + 1 if ok else 200)
            finally:
                timer.cancel()
        except (OSError, http.client.HTTPException, ValueError) as e:
            if time.monotonic() >= deadline:
                raise _NoAnswer(f"no complete answer within the {self.timeout_s:g} s deadline "
                                f"({type(e).__name__})") from None
            raise _NoAnswer(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if time.monotonic() >= deadline:  # the timer may have cut the body short without an error
            raise _NoAnswer(f"no complete answer within the {self.timeout_s:g} s deadline")
        if ok and len(data) > self.max_answer_bytes:
            raise _NoAnswer(f"answer over {self.max_answer_bytes} bytes "
                            "(--endpoint-max-answer-kb)")
        return resp.status, data


class ContextFull(Exception):
    """The dialogue has outgrown the request budget: the episode's context limit, not an error."""


class _NoAnswer(Exception):
    """An attempt that got no whole answer (connection, deadline, size): worth another try."""


def _shut(sock) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ChatPolicy:
    """rollout's policy for a chat endpoint: each active trajectory's messages go out in parallel
    (up to `workers` at once); the reply is text (no token row). A failed request is that
    trajectory's error; one past the request budget gets no reply (None: the rollout ends the
    episode), and `finish`, which the rollout calls at its end, names its status context_limit."""

    def __init__(self, endpoint: ChatEndpoint, workers: int = 16):
        self.endpoint, self.pool = endpoint, ThreadPoolExecutor(max(1, workers))
        self.full: list[Trajectory] = []  # ended by the budget, in this rollout

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply | EnvError | None]:
        def ask(t: Trajectory):
            try:
                return Reply(self.endpoint.chat(t.messages))
            except EnvError as e:
                return e
            except ContextFull:
                self.full.append(t)
                return None
        return list(self.pool.map(ask, trajs))

    def finish(self) -> None:
        for t in self.full:
            t.status = "context_limit"
        self.full = []
