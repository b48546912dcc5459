"""An OpenAI-compatible chat endpoint as eval.py's policy (`--endpoint URL --endpoint-model NAME`).

`ChatEndpoint` posts a rollout's messages to URL/chat/completions and returns the reply text,
retrying failed requests; `ChatPolicy` is the policy rollout.rollout plays: it asks the endpoint for
every active trajectory at once. A request that still fails is that trajectory's error (status
env_error, counted as an endpoint error), never a reply and never a score of 0.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from env_client import EnvError
from rollout import Reply, Trajectory

ENDPOINT_ERROR = "endpoint"  # the EnvError kind of a failed chat request: Trajectory.error's prefix


def policy(cfg) -> ChatPolicy:
    """The policy eval.py's --endpoint flags describe."""
    chat = ChatEndpoint(cfg.endpoint, cfg.endpoint_model, cfg.temperature, cfg.top_p,
                        cfg.max_new_tokens, cfg.endpoint_timeout_s, cfg.endpoint_retries)
    return ChatPolicy(chat, cfg.endpoint_workers)


def name(cfg) -> str:
    """The policy's name in eval.py's result ("policy")."""
    return f"endpoint {cfg.endpoint} ({cfg.endpoint_model})"


def is_endpoint_error(t: Trajectory) -> bool:
    """Whether the trajectory ended in a failed chat request (not a failure of the env server)."""
    return t.status == "env_error" and (t.error or "").startswith(f"[{ENDPOINT_ERROR}")


class ChatEndpoint:
    """POST {base}/chat/completions with the rollout's messages; returns the reply text.

    Failures (connection, timeout, HTTP error, malformed answer) raise EnvError("endpoint", ...)
    after `retries` extra attempts: a chat request does not change the game, so a retry is safe.
    """

    def __init__(self, base_url: str, model: str, temperature: float, top_p: float, max_tokens: int,
                 timeout_s: float = 120.0, retries: int = 2):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.max_tokens = max_tokens
        self.timeout_s, self.retries = timeout_s, retries

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "top_p": self.top_p,
                           "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
            req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"},
                                         method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    data = json.loads(resp.read())
                content = data["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"content is {type(content).__name__}")
                return content
            except urllib.error.HTTPError as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: {e.read()[:200]!r}", e.code)
                if e.code < 500 and e.code != 429:  # a 4xx but rate limiting will not get better
                    break
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: {type(e).__name__}: {e}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                why = f"{type(e).__name__}: {e}"
                last = EnvError(ENDPOINT_ERROR, f"{self.url}: malformed answer ({why})")
        raise last


class ChatPolicy:
    """rollout's policy for a chat endpoint: each active trajectory's messages go out in parallel
    (up to `workers` at once); the reply is text (no token row). A failed request is that
    trajectory's error."""

    def __init__(self, endpoint: ChatEndpoint, workers: int = 16):
        self.endpoint, self.pool = endpoint, ThreadPoolExecutor(max(1, workers))

    def replies(self, trajs: list[Trajectory], slots: list[int]) -> list[Reply | EnvError]:
        def ask(t: Trajectory):
            try:
                return Reply(self.endpoint.chat(t.messages))
            except EnvError as e:
                return e
        return list(self.pool.map(ask, trajs))
