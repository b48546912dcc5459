"""Replay logged trajectories in a browser: runs and their curves, steps, one trajectory turn by
turn and token by token, and two trajectories of one task side by side.

    python -m tools.viewer runs/fixed3 runs/scaling [--port 8008] [--host 127.0.0.1]
        [--tokenizer PATH]

Reads what train.py writes into a run folder (README, "Flags and the run folder"): metrics.jsonl for
the curves and each step's success rate, eval.jsonl for the held-out curve, rollouts/step_*.jsonl
for the trajectories, and checkpoint/model (or the `model` of config.json, or --tokenizer) for the
tokenizer of the token view. An evaluation opens too, by its result file, as one step 0: `python -m
tools.viewer runs/eval-start.json runs/eval-end.json` puts a start and an end side by side (eval.py
wrote their episodes beside them, as eval-start.rollouts.jsonl; a folder holding an older eval.py's
eval_rollouts.jsonl opens as well). Without a loadable tokenizer the token view shows token ids.

Pages (read-only; runs are addressed by index, steps by number, trajectories by 1-based line number
of the step file, so no part of a request is ever joined into a file path):
  /                                     runs
  /run/R                                curves (success, held-out success, reward, turns, horizon
                                        K), steps
  /run/R/step/S?env=&status=&task=&reward_min=&reward_max=&page=   the step's trajectories, 50 a
                                                                   page
  /run/R/step/S/traj/N                  one trajectory: turns, then every token coloured by
                                        loss_mask
  /run/R/step/S/compare?a=N&b=M         two trajectories side by side

Large runs stay fast: start-up reads nothing; the step list comes from file names and the success
rates from metrics.jsonl; a step page streams its one file (summaries cached per file version); a
trajectory page parses only its own line.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import sys

from flask import Flask, abort, jsonify, render_template_string, request
from markupsafe import Markup, escape
from werkzeug.exceptions import HTTPException

from env_server.__main__ import bounded  # a port in 0-65535, in argparse's line
from env_server.app import guard, make_server
from trainer.cli import Parser

PAGE_SIZE = 50
MAX_LINE = 10**9  # no step file has more lines; a larger number (say 20 digits) is a 404, not a 500
STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
EVAL_FILE = "eval_rollouts.jsonl"  # where an older eval.py wrote its episodes, beside its --out
EVAL_SUFFIX = ".rollouts.jsonl"  # eval.py's episodes now: runs/a.json -> runs/a.rollouts.jsonl
CURVES = [("success_rate", "training success"), ("reward_mean", "reward"), ("turns_mean", "turns"),
          ("max_turns", "horizon K")]
LOGGED_CURVES = [("update_kl", "update KL (before || after)"),
                 ("groups_informative", "informative groups")]  # when logged


# --------------------------------------------------------------------------------------------------
# Reading a run folder. Paths are built only from the folders given on the command line and from
# names listed in them; request values are integers looked up in those listings.

def step_files(run_dir: str) -> dict[int, str]:
    """{step: absolute path} of rollouts/step_*.jsonl, from the file names alone; a link that leads
    out of the run folder is left out (the viewer serves nothing else). A folder without them where
    eval.py wrote its episodes (EVAL_FILE) shows those as step 0, and so does an evaluation's result
    file."""
    if os.path.isfile(run_dir):
        episodes = os.path.splitext(run_dir)[0] + EVAL_SUFFIX
        return {0: episodes} if os.path.isfile(episodes) and inside(run_dir, episodes) else {}
    folder = os.path.join(run_dir, "rollouts")
    out = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = STEP_FILE.match(name)
        if m and inside(run_dir, os.path.join(folder, name)):
            out[int(m.group(1))] = os.path.join(folder, name)
    evaluated = os.path.join(run_dir, EVAL_FILE)
    if not out and os.path.isfile(evaluated) and inside(run_dir, evaluated):
        out[0] = evaluated
    return dict(sorted(out.items()))


def inside(run_dir: str, path: str) -> bool:
    """Whether `path`, links resolved, is in the run folder (an evaluation's: its result file's
    folder): the viewer follows no link out of it."""
    folder = os.path.dirname(run_dir) if os.path.isfile(run_dir) else run_dir
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def load_line(line: str):
    """One logged JSON line's value, or None where it cannot be read: not JSON (a line being
    written), or nested deeper than the parser goes (RecursionError). A lone surrogate ("\\ud800",
    as an endpoint may answer) becomes "?": a page cannot be sent in UTF-8 with one."""
    try:
        x = json.loads(line)
        return _utf8(x) if "\\ud" in line.lower() else x
    except (ValueError, RecursionError):
        return None


def _utf8(x):
    if isinstance(x, str):
        return x.encode("utf-8", "replace").decode("utf-8")
    if isinstance(x, list):
        return [_utf8(v) for v in x]
    return {_utf8(k): _utf8(v) for k, v in x.items()} if isinstance(x, dict) else x


def read_metrics(run_dir: str, name: str = "metrics.jsonl", bad: list | None = None) -> list[dict]:
    """metrics.jsonl (or eval.jsonl, the held-out evaluations) rows sorted by step; [] when absent
    or a link out of the run folder. One small line per step: read on every request. A row whose
    step is not a number has no place on a curve and is left out (sorting it among numbers, or
    keying by a list, was a 500). The numbers of lines that cannot be read go to `bad`."""
    path = os.path.join(run_dir, name)
    if not os.path.isfile(path) or not inside(run_dir, path):
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:  # a stray byte: not a 500
        for n, line in enumerate(f, start=1):
            if line.strip():
                rows.append(load_line(line))
                if rows[-1] is None and bad is not None and line.endswith("\n"):
                    bad.append(n)  # (a last line without its newline is still being written)
    return sorted((r for r in rows if isinstance(r, dict) and real(r.get("step"))),
                  key=lambda r: r["step"])


def real(x) -> bool:
    """Whether a logged value is a number to compare and draw: an int or float, not a bool, not a
    NaN (logs are JSON written by anything: a string, a None or a NaN where a number belongs)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def read_line(path: str, line_no: int) -> str | None:
    """The text of 1-based line `line_no`, streaming the file up to it; None past the end."""
    with open(path, encoding="utf-8", errors="replace") as f:  # a half-written line: not a 500
        for line in itertools.islice(f, line_no - 1, line_no):
            return line
    return None


SUMMARY_KEYS = ("env", "item_id", "group", "status", "reward", "turns", "max_turns")


@functools.lru_cache(maxsize=16)
def step_summaries(path: str, mtime_ns: int, size: int) -> tuple[list[dict], int]:
    """(summary of every trajectory with its line number, the numbers of unreadable lines) of one
    step file; cached per file version (mtime, size), so paging and filtering a large step parse
    it once."""
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            t = load_line(line)
            if not isinstance(t, dict):
                bad.append(n)
                continue
            rows.append({"line": n, **{k: t.get(k) for k in SUMMARY_KEYS}})
    return rows, bad


def summaries_of(path: str) -> tuple[list[dict], int]:
    st = os.stat(path)
    return step_summaries(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def load_tokenizer(run_dir: str, override: str | None):
    """(tokenizer or None, where it came from or why none loaded). Tried in order: --tokenizer, the
    run's checkpoint/model, the `model` in config.json; for an evaluation, the `policy` its result
    names."""
    candidates = [override] if override else []
    candidates.append(os.path.join(run_dir, "checkpoint", "model"))
    evaluation = os.path.isfile(run_dir)
    cfg_path = run_dir if evaluation else os.path.join(run_dir, "config.json")
    if os.path.isfile(cfg_path) and inside(run_dir, cfg_path):
        with open(cfg_path) as f:
            try:
                model = json.load(f).get("policy" if evaluation else "model")
            except (ValueError, AttributeError):
                model = None
        if isinstance(model, str) and model:
            candidates.append(model)
    reasons = []
    for c in candidates:
        if c == os.path.join(run_dir, "checkpoint", "model") and not os.path.isdir(c):
            continue
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(c), c
        except Exception as e:  # noqa: BLE001
            # degrade at the edge: say why and show token ids instead
            reasons.append(f"{c}: {type(e).__name__}: {str(e)[:200]}")
    return (None, "; ".join(reasons) or "no checkpoint/model, no model in config.json, no "
                                        "--tokenizer")


# --------------------------------------------------------------------------------------------------
# Drawing: inline SVG curves and the token view.

def num(x) -> str:
    """A number as a page shows it: floats to 3 significant digits (0.015625 -> 0.0156), the rest as
    is."""
    if isinstance(x, float) and not isinstance(x, bool):
        return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    return "" if x is None else str(x)


def svg_curve(xs: list, ys: list, title: str, width: int = 300, height: int = 120) -> Markup:
    """A polyline of ys against xs with min/max labels; no JS, no library."""
    pts = [(x, y) for x, y in zip(xs, ys) if real(x) and real(y) and math.isfinite(x)
           and math.isfinite(y)]  # a NaN or an infinity has no place on the axes
    pad = 28
    head = (f'<svg class="curve" width="{width}" height="{height}" '
            f'role="img"><title>{escape(title)}</title>')
    head += f'<text x="4" y="12" font-size="11">{escape(title)}</text>'
    if not pts:
        return Markup(head + '<text x="4" y="40" font-size="11" fill="#888">no data</text></svg>')
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)
    coords = " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}"
                      for x, y in pts)
    body = (f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{coords}"/>'
            f'<text x="2" y="{pad}" font-size="9">{y1:.3g}</text>'
            f'<text x="2" y="{height - pad}" font-size="9">{y0:.3g}</text>'
            f'<text x="{pad}" y="{height - 8}" font-size="9">step {x0}</text>'
            f'<text x="{width - pad}" y="{height - 8}" font-size="9" text-anchor="end">{x1}</text>')
    return Markup(head + body + "</svg>")


def token_view(t: dict, tokenizer) -> dict:
    """Every token of `token_ids` with its text (or id), loss_mask and logprob, plus the checks that
    make a wrong mask or a drifted template visible: equal lengths, and one sampled span per policy
    turn."""
    ids, mask, lps = t.get("token_ids") or [], t.get("loss_mask") or [], t.get("logprobs") or []
    problems = []
    if not (len(ids) == len(mask) == len(lps)):
        problems.append(f"lengths differ: token_ids {len(ids)}, loss_mask {len(mask)}, logprobs "
                        f"{len(lps)}")
    texts = token_texts(ids, tokenizer)
    tokens = []
    for k, (i, txt) in enumerate(zip(ids, texts)):
        m = mask[k] if k < len(mask) else None
        lp = lps[k] if k < len(lps) else None
        tokens.append({"id": i, "text": txt, "sampled": m == 1,
                       "tip": f"#{k} id {i} mask {m} logprob {num(lp)}"})
    spans = sum(1 for k, tok in enumerate(tokens) if tok["sampled"]
                and (k == 0 or not tokens[k - 1]["sampled"]))
    replies = sum(1 for m in t.get("messages") or [] if isinstance(m, dict)
                  and m.get("role") == "assistant")
    # One sampled span per policy turn (`turns`); scripted assistant replies (an agent scheme's
    # instruction turn) are context, so the span count is checked against `turns`, not the replies.
    turns = t.get("turns")
    if isinstance(turns, int) and spans != turns:
        problems.append(f"{spans} sampled spans for {turns} policy turns: a wrong mask or a "
                        "drifted template?")
    return {"tokens": tokens, "sampled": sum(tok["sampled"] for tok in tokens), "spans": spans,
            "replies": replies, "problems": problems}


def token_texts(ids: list, tokenizer) -> list[str]:
    """Each token's text, or its id in brackets where there is no tokenizer or the id is none it
    can decode (not an integer, outside the vocabulary: the tokenizer raises on those)."""
    texts = [f"[{i}]" for i in ids]
    if tokenizer is None:
        return texts
    known = [k for k, i in enumerate(ids) if type(i) is int and 0 <= i < len(tokenizer)]
    for k, text in zip(known, tokenizer.batch_decode([[ids[k]] for k in known])):
        texts[k] = text
    return texts


# --------------------------------------------------------------------------------------------------
# Templates. render_template_string autoescapes: every string from a log is shown as text.

BASE = """<!doctype html><html><head><meta charset="utf-8"><title>{{ title }}</title><style>
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222} a{color:#1a5fb4}
table{border-collapse:collapse} td,th{border:1px solid #ddd;padding:2px 8px;text-align:left;\
font-size:13px}
.msg{border-left:4px solid #ccc;margin:6px 0;padding:4px 8px;white-space:pre-wrap;\
font-family:monospace;font-size:13px}
.role-assistant{border-color:#2e7d32;background:#f1f8f1} .role-user{border-color:#1565c0;\
background:#f0f5fc}
.role-system{border-color:#888;background:#f6f6f6}
.tokens{white-space:pre-wrap;font-family:monospace;font-size:13px;line-height:1.7;\
border:1px solid #ddd;padding:6px}
.tok{border-radius:2px;outline:1px solid rgba(0,0,0,.08)} .tok.sampled{background:#b9f6ca} \
.tok.context{background:#eceff1}
.problem{color:#b71c1c;font-weight:bold} .side{display:flex;gap:1em} .side>div{flex:1;min-width:0}
</style></head><body><p><a href="/">runs</a>{% for href, text in crumbs %} / \
<a href="{{ href }}">{{ text }}</a>{% endfor %}</p>
<h2>{{ title }}</h2>{{ body }}</body></html>"""

INDEX = """<table><tr><th>#</th><th>run</th><th>steps logged</th><th>last success</th></tr>
{% for r in runs %}<tr><td>{{ r.i }}</td><td><a class="run" href="/run/{{ r.i }}">{{ r.name }}</a>\
</td>
{% if r.error %}<td colspan="2" class="problem">cannot read: {{ r.error }}</td>{% else %}\
<td>{{ r.steps }}</td><td>{{ r.last|num }}</td>{% endif %}</tr>{% endfor %}</table>"""

RUN = """{% for name, lines in bad %}<p class="problem">{{ name }}: {{ lines|length }} unreadable \
lines: {{ lines[:20]|join(", ") }}</p>{% endfor %}
<div>{% for svg in curves %}{{ svg }}{% endfor %}</div>
<h3>steps</h3>{% if not steps %}<p>no rollouts/step_*.jsonl yet</p>{% endif %}
<table><tr><th>step</th><th>K</th><th>success</th><th>reward</th><th>turns</th></tr>
{% for s in steps %}<tr><td><a class="step" href="/run/{{ run }}/step/{{ s.step }}">step \
{{ s.step }}</a></td>
<td>{{ s.m.get('max_turns', '') }}</td><td>{{ s.m.get('success_rate', '')|num }}</td>
<td>{{ s.m.get('reward_mean', '')|num }}</td><td>{{ s.m.get('turns_mean', '')|num }}</td>\
</tr>{% endfor %}</table>"""

STEP = """<form method="get">env <input name="env" value="{{ q.env }}" size="8"> status \
<select name="status">
<option value="">any</option>{% for s in statuses %}\
<option {{ 'selected' if q.status == s }}>{{ s }}</option>{% endfor %}
</select> task <input name="task" value="{{ q.task }}" size="6"> reward from \
<input name="reward_min"
value="{{ q.reward_min }}" size="4"> to <input name="reward_max" value="{{ q.reward_max }}" \
size="4">
<button>filter</button></form>
<p>{{ total }} trajectories match{% if bad %}, <span class="problem">{{ bad|length }} unreadable \
lines: {{ bad[:20]|join(", ") }}</span>{% endif %};
page {{ page }} of {{ pages }}
{% if page > 1 %}<a class="prev" href="?{{ qs(page - 1) }}">previous</a>{% endif %}
{% if page < pages %}<a class="next" href="?{{ qs(page + 1) }}">next</a>{% endif %}</p>
<table><tr><th>line</th><th>env</th><th>task</th><th>group</th><th>status</th><th>reward</th>\
<th>turns</th><th></th></tr>
{% for t in rows %}<tr><td><a class="traj" href="/run/{{ run }}/step/{{ step }}/traj/{{ t.line }}">\
line {{ t.line }}</a></td>
<td>{{ t.env }}</td><td>{{ t.item_id }}</td><td>{{ t.group }}</td><td>{{ t.status }}</td>\
<td>{{ t.reward|num }}</td>
<td>{{ t.turns }}</td><td>{% if t.pair %}<a class="compare"
href="/run/{{ run }}/step/{{ step }}/compare?a={{ t.pair[0] }}&amp;b={{ t.pair[1] }}">best vs \
worst of task</a>
{% endif %}</td></tr>
{% endfor %}</table>"""

TURNS = """<p>env {{ t.env }} · task {{ t.item_id }} · group {{ t.group }} · status \
<b class="status">{{ t.status }}</b>
· reward <b class="reward">{{ t.reward|num }}</b> · turns {{ t.turns }} of K={{ t.max_turns }}</p>
{% for m in msgs %}<div class="msg role-{{ m.role }}"><b>{{ m.label }}</b>
{{ m.content }}</div>{% endfor %}"""

TRAJ = TURNS + """<h3>tokens</h3><p>{{ tv.tokens|length }} tokens, \
<span class="tok sampled">sampled by the policy
(loss_mask 1)</span> {{ tv.sampled }} in {{ tv.spans }} spans, \
<span class="tok context">not sampled</span>;
{{ t.turns }} policy turns, {{ tv.replies }} assistant replies. Text: {{ tok_source }}. Hover a \
token for its id, mask and logprob.</p>
{% for p in tv.problems %}<p class="problem">{{ p }}</p>{% endfor %}
<div class="tokens">{% for k in tv.tokens %}<span class="tok \
{{ 'sampled' if k.sampled else 'context' }}" title="{{ k.tip }}">{{ k.text }}</span>{% endfor %}\
</div>"""

COMPARE = """<div class="side">{% for side in sides %}<div><h3>\
<a href="{{ side.href }}">line {{ side.line }}</a></h3>
{{ side.html }}</div>{% endfor %}</div>"""


def page(title: str, body: str, crumbs=(), status: int = 200, **ctx):
    inner = render_template_string(body, **ctx)
    return render_template_string(BASE, title=title, body=Markup(inner), crumbs=crumbs), status


def turn_messages(t: dict) -> list[dict]:
    """messages with labels: the first user message is the task, later ones observations."""
    out, seen_user = [], False
    for m in t.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "?"))
        label = {"assistant": "assistant", "system": "system"}.get(role, role)
        if role == "user":
            label, seen_user = ("observation" if seen_user else "task"), True
        out.append({"role": role, "label": label, "content": str(m.get("content", ""))})
    return out


# --------------------------------------------------------------------------------------------------
# The app.

def create_app(run_dirs: list[str], tokenizer: str | None = None, host: str = "127.0.0.1") -> Flask:
    """The viewer of `run_dirs`, to be bound to `host`: on loopback it answers no other site's page
    and no DNS-rebinding page (env_server.app.guard)."""
    runs = [os.path.abspath(d) for d in run_dirs]
    for d in runs:
        if os.path.isfile(d) and not step_files(d):
            raise ValueError(f"{d}: not a run folder, and no evaluation's episodes beside it "
                             f"({os.path.basename(os.path.splitext(d)[0] + EVAL_SUFFIX)})")
        if not os.path.exists(d):
            raise ValueError(f"{d}: no such folder or file")
    app = guard(Flask(__name__), host)
    app.jinja_env.filters["num"] = num

    def run_dir(r: int) -> str:
        if not 0 <= r < len(runs):
            abort(404, f"no run {r} (runs 0..{len(runs) - 1})")
        return runs[r]

    def step_path(r: int, s: int) -> str:
        files = step_files(run_dir(r))
        if s not in files:
            abort(404, f"run {r} has no step {s}")
        return files[s]

    def trajectory(r: int, s: int, n: int) -> dict:
        line = read_line(step_path(r, s), n) if 1 <= n <= MAX_LINE else None
        if line is None or not line.strip():
            abort(404, f"run {r} step {s} has no trajectory on line {n}")
        t = load_line(line)
        if t is None:
            abort(422, f"run {r} step {s} line {n} is not valid JSON, or is nested too deep")
        if not isinstance(t, dict) or not all(isinstance(t.get(k) or [], list) for k in
                                               ("token_ids", "loss_mask", "logprobs", "messages")):
            abort(422, f"run {r} step {s} line {n} is not a trajectory (a JSON object with lists "
                       "of token_ids, loss_mask, logprobs and messages)")
        return t

    def int_arg(name: str, default=None, low=None):
        v = request.args.get(name, "")
        if v == "":
            return default
        try:
            x = int(v)
        except ValueError:
            abort(400, f"{name} must be an integer, got {v!r}")
        if low is not None and x < low:
            abort(400, f"{name} must be at least {low}")
        return x

    def float_arg(name: str):
        v = request.args.get(name, "")
        if v == "":
            return None
        try:
            x = float(v)
        except ValueError:
            abort(400, f"{name} must be a number, got {v!r}")
        if x != x:
            abort(400, f"{name} must be a number, got NaN")
        return x

    def crumbs(r, s=None):
        out = [(f"/run/{r}", os.path.basename(runs[r]))]
        if s is not None:
            out.append((f"/run/{r}/step/{s}", f"step {s}"))
        return out

    @app.errorhandler(HTTPException)
    def http_error(e):
        if request.path.startswith("/api/") or request.accept_mimetypes.best == "application/json":
            return jsonify(error=e.description), e.code
        return page(f"{e.code} {e.name}", "<p class='error'>{{ msg }}</p>", status=e.code,
                    msg=e.description)

    @app.get("/")
    def index():
        rows = []
        for i, d in enumerate(runs):
            try:  # one run that cannot be read is its own row, not a 500 that hides the others
                metrics = read_metrics(d)
                rows.append({"i": i, "name": d, "steps": len(step_files(d)),
                             "last": metrics[-1].get("success_rate", "") if metrics else ""})
            except Exception as e:  # noqa: BLE001 -- degrade at the edge: shown, never hidden
                rows.append({"i": i, "name": d, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return page("runs", INDEX, runs=rows)

    @app.get("/run/<int:r>")
    def run_page(r: int):
        d = run_dir(r)
        bad = {"metrics.jsonl": [], "eval.jsonl": []}
        metrics = read_metrics(d, bad=bad["metrics.jsonl"])
        by_step = {m["step"]: m for m in metrics}
        xs = [m["step"] for m in metrics]
        drawn = CURVES + [(k, t) for k, t in LOGGED_CURVES if any(k in m for m in metrics)]
        curves = [svg_curve(xs, [m.get(k) for m in metrics], title) for k, title in drawn]
        evals = read_metrics(d, "eval.jsonl", bad["eval.jsonl"])
        if evals:  # the held-out evaluations train.py wrote (step 0 = before training)
            curves.insert(1,
                          svg_curve([e["step"] for e in evals],
                                    [e.get("success_rate") for e in evals], "held-out success "
                                    f"({evals[-1].get('tasks', '?')} test tasks)"))
        steps = [{"step": s, "m": by_step.get(s, {})} for s in step_files(d)]
        return page(os.path.basename(d), RUN, (), run=r, curves=curves, steps=steps,
                    bad=[(name, lines) for name, lines in bad.items() if lines])

    @app.get("/run/<int:r>/step/<int:s>")
    def step_page(r: int, s: int):
        path = step_path(r, s)
        q = {k: request.args.get(k, "") for k in ("env", "status", "task", "reward_min",
                                                  "reward_max")}
        lo, hi = float_arg("reward_min"), float_arg("reward_max")
        pg = int_arg("page", 1, low=1)
        rows, bad = summaries_of(path)
        # best and worst of each task's group, over the whole step (not only the filtered rows)
        groups: dict = {}
        for t in rows:
            groups.setdefault((str(t["item_id"]), str(t["group"])), []).append(t)
        pairs = {}
        for members in groups.values():
            scored = [t for t in members if real(t["reward"])]
            if len(scored) >= 2:
                best = max(scored, key=lambda t: t["reward"])
                worst = min(scored, key=lambda t: t["reward"])
                if best is not worst:
                    pairs[best["line"]] = pairs[worst["line"]] = (best["line"], worst["line"])
        sel = [t for t in rows
               if (not q["env"] or str(t["env"]) == q["env"])
               and (not q["status"] or str(t["status"]) == q["status"])
               and (not q["task"] or str(t["item_id"]) == q["task"])
               and (lo is None or (real(t["reward"]) and t["reward"] >= lo))
               and (hi is None or (real(t["reward"]) and t["reward"] <= hi))]
        pages = max(1, -(-len(sel) // PAGE_SIZE))
        if pg > pages:
            abort(404, f"page {pg} of {pages}")
        shown = [{**t, "pair": pairs.get(t["line"])}
                 for t in sel[(pg - 1) * PAGE_SIZE: pg * PAGE_SIZE]]

        def qs(p: int) -> str:
            from urllib.parse import urlencode
            return urlencode({**{k: v for k, v in q.items() if v}, "page": p})

        statuses = sorted({str(t["status"]) for t in rows} | {"done", "max_turns", "context_limit",
                                                              "env_error"})
        return page(f"{os.path.basename(runs[r])} step {s}", STEP, crumbs(r), run=r, step=s, q=q,
                    rows=shown, total=len(sel), bad=bad, page=pg, pages=pages, qs=qs,
                    statuses=statuses)

    @app.get("/run/<int:r>/step/<int:s>/traj/<int:n>")
    def traj_page(r: int, s: int, n: int):
        t = trajectory(r, s, n)
        tok, source = load_tokenizer(runs[r], tokenizer)
        tok_source = f"decoded with the tokenizer of {source}" if tok is not None else \
            f"token ids (no tokenizer: {source})"
        return page(f"step {s} line {n}", TRAJ, crumbs(r, s), t=t, msgs=turn_messages(t),
                    tv=token_view(t, tok), tok_source=tok_source)

    @app.get("/run/<int:r>/step/<int:s>/compare")
    def compare_page(r: int, s: int):
        a, b = int_arg("a", low=1), int_arg("b", low=1)
        if a is None or b is None:
            abort(400, "compare needs two line numbers: ?a=N&b=M")
        sides = []
        for n in (a, b):
            t = trajectory(r, s, n)
            html = Markup(render_template_string(TURNS, t=t, msgs=turn_messages(t)))
            sides.append({"line": n, "href": f"/run/{r}/step/{s}/traj/{n}", "html": html})
        return page(f"step {s}: line {a} vs line {b}", COMPARE, crumbs(r, s), sides=sides)

    return app


def main(argv=None) -> None:
    p = Parser(prog="python -m tools.viewer", description=__doc__)  # one-line errors
    p.add_argument("runs", nargs="+", help="run folders written by train.py --out, or eval.py's "
                                           "result files (their episodes beside them)")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8008,
                   help="port to serve on (0: a free one, printed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0 exposes the logs to anyone who reaches the port: "
                        "no authentication)")
    p.add_argument("--tokenizer", default=None, help="HF folder or hub name whose tokenizer "
                                                     "decodes the token view")
    a = p.parse_args(argv)
    try:
        app = create_app(a.runs, a.tokenizer, a.host)
    except ValueError as e:
        p.error(str(e))
    try:
        server = make_server(app, a.host, a.port, ident="viewer")
    except OSError as e:  # the port is taken, or the address is not this machine's
        sys.exit(f"viewer.py: cannot listen on {a.host}:{a.port} ({e.strerror or e}): give another "
                 "--port")
    except ValueError as e:  # waitress: an address that is no address (999.1.1.1)
        sys.exit(f"viewer.py: cannot listen on {a.host}:{a.port} ({e}): give another --host")
    print(f"serving {len(a.runs)} run(s) on http://{a.host}:{server.effective_port}", flush=True)
    server.run()


if __name__ == "__main__":
    main()
