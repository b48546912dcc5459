"""viewer.py: Flask test-client tests (run and step pages, pagination, filters, compare, 4xx on bad
or hostile requests, escaping, lazy reading) and one real headless-chromium test that clicks from
the index to a trajectory, checks the token colours and the escaping, and saves a screenshot into
VIEWER_ARTIFACTS (default: the test's tmp_path). The browser test skips without chromium,
chromedriver or selenium."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

from tools import viewer

XSS = "<script>alert(1)</script>"


def trajectory(item_id, group, reward, status="done", env="corridor", text="go left", mask=None):
    """A two-turn trajectory: task, reply, observation, reply; token ids 0.. with a mask of two
    sampled spans."""
    mask = mask if mask is not None else [0, 0, 0, 1, 1, 0, 0, 1]
    return {"step": 1, "env": env, "item_id": item_id, "group": group, "max_turns": 3, "turns": 2,
            "status": status, "reward": reward,
            "messages": [{"role": "user", "content": f"task {item_id}: reach the end"},
                         {"role": "assistant", "content": text},
                         {"role": "user", "content": "you moved"},
                         {"role": "assistant", "content": "go right"}],
            "token_ids": list(range(len(mask))), "loss_mask": mask,
            "logprobs": [-0.25 if m else 0.0 for m in mask]}


def write_run(folder, steps: dict[int, list[dict]], metrics_steps=None):
    os.makedirs(os.path.join(folder, "rollouts"))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in metrics_steps or steps:
            f.write(json.dumps({"step": s, "max_turns": 3, "success_rate": 0.25 * s,
                                "reward_mean": 0.5, "turns_mean": 2.0}) + "\n")
    for s, trajs in steps.items():
        with open(os.path.join(folder, "rollouts", f"step_{s:06d}.jsonl"), "w") as f:
            for t in trajs:
                f.write(json.dumps(t) + "\n")
    return folder


@pytest.fixture
def client(tmp_path):
    trajs = [trajectory(7, 0, 1.0), trajectory(7, 0, 0.0, status="max_turns", text=XSS),
             trajectory(8, 1, 0.5, env="babyai"),
             trajectory(8, 1, 0.5, env="babyai", status="env_error")]
    run = write_run(tmp_path / "run_a", {1: trajs, 2: [trajectory(i, i, 1.0) for i in range(120)]})
    # a step file the requests below never ask for: garbage must not matter to other pages
    # (not JSON; JSON but no object; bytes that are not UTF-8; an object whose rows are no lists)
    (tmp_path / "run_a" / "rollouts" / "step_000003.jsonl").write_bytes(
        b'{not json\n[1, 2, 3]\n{"status": "\xff\xfe\n{"token_ids": 5}\n')
    return viewer.create_app([str(run)]).test_client()


def test_index_and_run_page_show_curves_and_steps(client):
    r = client.get("/")
    assert r.status_code == 200 and b'href="/run/0"' in r.data
    r = client.get("/run/0")
    html = r.get_data(as_text=True)
    assert r.status_code == 200 and html.count("<svg") == 4 and "horizon K" in html
    for s in (1, 2, 3):
        assert f'href="/run/0/step/{s}"' in html
    assert "<td>0.5</td>" in html  # step 2's success rate, read from metrics.jsonl


def test_the_run_page_draws_the_held_out_curve_from_eval_jsonl(tmp_path):
    run = write_run(tmp_path / "run_e", {1: [trajectory(1, 0, 1.0)]})
    app = viewer.create_app([str(run)]).test_client()
    # no eval.jsonl: no curve
    assert "held-out success" not in app.get("/run/0").get_data(as_text=True)
    with open(os.path.join(run, "eval.jsonl"), "w") as f:
        for step, rate in ((0, 0.1), (1, 0.4)):
            f.write(json.dumps({"step": step, "success_rate": rate, "tasks": 12,
                                "max_turns": 3}) + "\n")
    html = app.get("/run/0").get_data(as_text=True)
    assert html.count("<svg") == 5 and "held-out success (12 test tasks)" in html
    assert ">0.4<" in html and ">0.1<" in html  # the curve's range, read from eval.jsonl


def test_an_evaluation_opens_as_step_0(tmp_path):
    # eval.py --out runs/start.json and --out runs/end.json: one folder, each its own episodes
    folder = tmp_path / "runs"
    folder.mkdir()
    for name, rewards in (("start", (1.0, 0.0)), ("end", (1.0, 1.0, 0.0))):
        with open(folder / f"{name}.rollouts.jsonl", "w") as f:
            for r in rewards:
                t = trajectory(3, 0, r, status="done" if r else "max_turns", env="textcraft")
                f.write(json.dumps({**t, "step": 0}) + "\n")
        (folder / f"{name}.json").write_text(json.dumps({"policy": str(tmp_path / "no-model")}))
    app = viewer.create_app([str(folder / "start.json"), str(folder / "end.json")]).test_client()
    assert 'href="/run/0/step/0"' in app.get("/run/0").get_data(as_text=True)
    for r, n in ((0, 2), (1, 3)):
        html = app.get(f"/run/{r}/step/0").get_data(as_text=True)
        assert html.count(f'href="/run/{r}/step/0/traj/') == n and "max_turns" in html
    page = app.get("/run/1/step/0/traj/3").get_data(as_text=True)
    assert "no-model" in page  # the tokenizer was looked for where the result says the policy was
    assert app.get("/run/1/step/0/traj/4").status_code == 404
    (folder / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="other.rollouts.jsonl"):  # a result without its episodes
        viewer.create_app([str(folder / "other.json")])
    with pytest.raises(ValueError, match="no such folder or file"):
        viewer.create_app([str(folder / "gone.json")])
    # a folder where an older eval.py wrote eval_rollouts.jsonl still opens
    old = tmp_path / "eval-old"
    old.mkdir()
    (old / "eval_rollouts.jsonl").write_text(json.dumps({**trajectory(3, 0, 1.0), "step": 0})
                                             + "\n")
    assert list(viewer.step_files(str(old))) == [0]
    # a run folder's own steps win: its eval_rollouts.jsonl (if any) is not a step
    run = write_run(tmp_path / "run_x", {1: [trajectory(1, 0, 1.0)]})
    (tmp_path / "run_x" / "eval_rollouts.jsonl").write_text(json.dumps(trajectory(2, 0, 0.0))
                                                            + "\n")
    assert list(viewer.step_files(str(run))) == [1]


def test_bad_and_hostile_requests_are_4xx_never_500(client):
    for url in ["/run/1", "/run/99999999999999999999", "/run/-1", "/run/x", "/run/0/step/4",
                "/run/0/step/..%2F..", "/run/0/step/../../etc/passwd", "/run/0/step/1/traj/-1",
                "/run/0/step/1/traj/0", "/run/0/step/1/traj/5",
                "/run/0/step/1/traj/..%2F..%2Fmetrics.jsonl",
                "/run/0/step/2?page=4", "/run/0/step/1/compare?a=1&b=9",
                "/%2e%2e/%2e%2e/etc/passwd"]:
        assert client.get(url).status_code == 404, url
    for url in ["/run/0/step/1?page=abc", "/run/0/step/1?page=0", "/run/0/step/1?page=-1",
                "/run/0/step/1?reward_min=x", "/run/0/step/1?reward_max=nan",
                "/run/0/step/1/compare?a=1",
                "/run/0/step/1/compare?a=-1&b=2", "/run/0/step/1/compare?a=1&b=zz"]:
        assert client.get(url).status_code == 400, url
    r = client.get("/run/0/step/3/traj/1")  # a line that is not JSON: said so, not a crash
    assert r.status_code == 422 and b"not valid JSON" in r.data
    for n in (2, 3, 4):
        assert client.get(f"/run/0/step/3/traj/{n}").status_code == 422, n
    r = client.get("/run/0/step/3")  # the step page counts them, unreadable
    assert r.status_code == 200 and "3 unreadable" in r.get_data(as_text=True)
    r = client.get("/run/7", headers={"Accept": "application/json"})
    assert r.status_code == 404 and r.get_json() == {"error": "no run 7 (runs 0..0)"}


def test_pagination(client):
    html = client.get("/run/0/step/2").get_data(as_text=True)
    assert ("120 trajectories match" in html and html.count('class="traj"') == 50
            and "page 1 of 3" in html)
    assert 'class="next" href="?page=2"' in html and 'class="prev"' not in html
    html = client.get("/run/0/step/2?page=3").get_data(as_text=True)
    assert (html.count('class="traj"') == 20 and 'href="/run/0/step/2/traj/101"' in html
            and 'class="next"' not in html)


def test_filters(client):
    def lines(query):
        r = client.get("/run/0/step/1" + query)
        assert r.status_code == 200, query
        return [int(x.split('"')[0]) for x in r.get_data(as_text=True).split('/traj/')[1:]]
    assert lines("") == [1, 2, 3, 4]
    assert lines("?env=babyai") == [3, 4]
    assert lines("?status=max_turns") == [2]
    assert lines("?task=7") == [1, 2]
    assert lines("?reward_min=0.4&reward_max=0.6") == [3, 4]
    assert lines("?reward_min=2") == []
    html = client.get("/run/0/step/2?task=5&page=1").get_data(as_text=True)
    assert "1 trajectories match" in html


def test_trajectory_turns_tokens_and_escaping_without_tokenizer(client):
    html = client.get("/run/0/step/1/traj/2").get_data(as_text=True)
    assert XSS not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "task 7: reach the end" in html and "you moved" in html and "max_turns" in html
    assert (html.count('class="tok sampled" title') == 3
            and html.count('class="tok context" title') == 5)
    assert 'title="#3 id 3 mask 1 logprob -0.25"' in html and "[3]</span>" in html
    assert "no tokenizer" in html and "3 in 2 spans" in html and "2 policy turns" in html
    assert 'class="problem"' not in html


def test_a_wrong_mask_is_flagged(tmp_path):
    # one span for two replies: template drift
    bad = trajectory(1, 0, 1.0, mask=[0, 1, 1, 1, 1, 1, 1, 1])
    short = {**trajectory(1, 0, 0.0), "logprobs": [0.0]}
    run = write_run(tmp_path / "r", {1: [bad, short]})
    c = viewer.create_app([str(run)]).test_client()
    assert ("1 sampled spans for 2 policy turns"
            in c.get("/run/0/step/1/traj/1").get_data(as_text=True))
    assert "logprobs 1" in c.get("/run/0/step/1/traj/2").get_data(as_text=True)


def test_compare_best_and_worst_of_a_group(client):
    html = client.get("/run/0/step/1").get_data(as_text=True)
    assert html.count('href="/run/0/step/1/compare?a=1&amp;b=2"') == 2  # task 7: reward 1 vs 0
    html = client.get("/run/0/step/1/compare?a=1&b=2").get_data(as_text=True)
    assert (html.count('class="msg role-assistant"') == 4 and "&lt;script&gt;" in html
            and XSS not in html)
    assert 'href="/run/0/step/1/traj/1"' in html and 'href="/run/0/step/1/traj/2"' in html


def test_a_trajectory_page_reads_only_up_to_its_line(tmp_path):
    """Line 1 is served although the rest of the file is garbage: the file is streamed, not parsed
    whole."""
    run = write_run(tmp_path / "r", {1: [trajectory(1, 0, 1.0)]})
    with open(run / "rollouts" / "step_000001.jsonl", "a") as f:
        f.write("{garbage\n" * 1000)
    c = viewer.create_app([str(run)]).test_client()
    assert c.get("/run/0/step/1/traj/1").status_code == 200
    assert "1000 unreadable lines" in c.get("/run/0/step/1").get_data(as_text=True)


def test_cli_rejects_a_missing_folder(tmp_path):
    res = subprocess.run([sys.executable, "-m", "tools.viewer", str(tmp_path / "nope")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "nope: no such folder or file" in res.stderr


def test_a_taken_port_is_one_line(tmp_path):
    import socket

    write_run(tmp_path / "run", {1: [trajectory(7, 0, 1.0)]})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "tools.viewer", str(tmp_path / "run"),
                              "--port", str(port)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert (res.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in res.stderr
            and "--port" in res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_numbers_are_shown_rounded(tmp_path):
    run = tmp_path / "run"
    write_run(run, {1: [trajectory(7, 0, 0.015625)]})
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "max_turns": 3, "success_rate": 0.015625,
                            "reward_mean": 1 / 3, "turns_mean": 2.0}) + "\n")
    c = viewer.create_app([str(run)]).test_client()
    pages = [c.get(p).get_data(as_text=True)
             for p in ("/", "/run/0", "/run/0/step/1", "/run/0/step/1/traj/1")]
    assert not any("0.015625" in html or "0.3333" in html for html in pages)
    assert ("<td>0.0156</td>" in pages[0] and "<td>0.333</td>" in pages[1]
            and "<td>0.0156</td>" in pages[2])
    assert 'class="reward">0.0156<' in pages[3]
    assert ([viewer.num(x) for x in (0.015625, 2.0, 3, 12345.6, None, "a")]
            == ["0.0156", "2", "3", "12346", "", "a"])


ODD = [float("nan"), float("inf"), "x", None, [1], {"a": 1}, True]  # where a number belongs


def test_odd_metric_and_token_values_render(tmp_path):
    """Logs are JSON anyone may write: each odd value once made a page a 500 (a step that is no
    number, in metrics.jsonl or eval.jsonl; a byte that is not UTF-8; an id the tokenizer cannot
    decode). Now rows without a numeric step are left out and odd values are shown as they are."""
    run = tmp_path / "run"
    odd_tokens = [float("nan"), "x", None, 10 ** 12, -1, 2.0]
    trajs = [trajectory(7, 0, v) for v in ODD] + [
        {**trajectory(8, 1, 1.0), "turns": "two", "max_turns": None},
        {**trajectory(8, 1, 0.0), "token_ids": [1, *odd_tokens, 3],
         "logprobs": ["a", None, float("nan"), 0, 0, 0, 0, -0.5]}]
    write_run(run, {1: trajs})
    with open(run / "metrics.jsonl", "w") as f:
        for step, v in [(1, 0.5), ("x", 0.5), ([1], 0.5), (None, 0.5), (2, float("nan")),
                        (3, "x"), (4, None), (5, float("inf")), (6, [1]), (7, 0.25)]:
            f.write(json.dumps({"step": step, "max_turns": v, "success_rate": v, "reward_mean": v,
                                "turns_mean": v, "update_kl": v}) + "\n")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 8, "success_rate": "\xff"}\n')
    with open(run / "eval.jsonl", "w") as f:
        for step in ("x", 0, None, 1):
            f.write(json.dumps({"step": step, "success_rate": "y" if step else float("nan"),
                                "tasks": None}) + "\n")
    vocab = make_tokenizer(run / "checkpoint" / "model", [])
    c = viewer.create_app([str(run)]).test_client()
    for url in ["/", "/run/0", "/run/0/step/1", "/run/0/step/1?reward_min=0&reward_max=1",
                *[f"/run/0/step/1/traj/{n}" for n in range(1, len(trajs) + 1)],
                "/run/0/step/1/compare?a=1&b=2"]:
        assert c.get(url).status_code == 200, url
    html = c.get("/run/0").get_data(as_text=True)
    # four curves, update KL and the held-out one; no NaN or infinity among the points
    assert html.count("<svg") == 6 and "nan," not in html and "inf," not in html
    tokens = c.get(f"/run/0/step/1/traj/{len(trajs)}").get_data(as_text=True)
    shown = [f">[{v}]</span>" for v in ("nan", "x", "None", 10 ** 12, -1, 2.0)]
    assert all(x in tokens for x in shown), tokens  # ids the tokenizer cannot decode
    assert f'id 1 mask 0 logprob a">{list(vocab)[1]}</span>' in tokens  # the others decoded
    assert viewer.real(1) and viewer.real(0.5) and not any(map(viewer.real, ODD[:1] + ODD[2:]))


def test_a_run_that_cannot_be_read_is_an_error_row_and_the_others_list(tmp_path, monkeypatch):
    good = write_run(tmp_path / "good", {1: [trajectory(1, 0, 1.0)]})
    bad = write_run(tmp_path / "bad", {1: [trajectory(1, 0, 1.0)]})
    real_files = viewer.step_files

    def step_files(d):
        if d == str(bad):
            raise PermissionError(13, "Permission denied", d + "/rollouts")
        return real_files(d)

    monkeypatch.setattr(viewer, "step_files", step_files)
    r = viewer.create_app([str(bad), str(good)]).test_client().get("/")
    html = r.get_data(as_text=True)
    assert r.status_code == 200 and 'href="/run/1"' in html and "<td>1</td>" in html
    assert "cannot read: PermissionError: [Errno 13] Permission denied" in html


# --------------------------------------------------------------------------------------------------
# The real browser.

def make_tokenizer(folder, extra_tokens):
    """A word-level HF tokenizer saved as the run's checkpoint/model, so the viewer decodes with
    it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<|im_start|>", "user", "\n", "assistant", " go", " left",
                                         "<|im_end|>", "[UNK]", *extra_tokens])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(folder))
    return vocab


def browser_or_skip():
    chromium = (shutil.which("chromium") or shutil.which("chromium-browser")
                or shutil.which("google-chrome"))
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("chromium and chromedriver not installed "
                    "(apt-get install -y chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium not installed (pip install selenium)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1300,1000"):
        opts.add_argument(a)
    # an explicit chromedriver: Selenium Manager would otherwise try to download one
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver))


def test_browser_click_through_to_token_view(tmp_path):
    from env_server.app import serve_wsgi_in_thread

    driver = browser_or_skip()
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    artifacts = os.environ.get("VIEWER_ARTIFACTS") or str(tmp_path)
    os.makedirs(artifacts, exist_ok=True)
    run = tmp_path / "corridor_grpo"
    # token ids spell a ChatML conversation; one token is the script tag itself (escaping in the
    # token view)
    ids = [0, 1, 2, 8, 6, 2, 0, 3, 2, 4, 5, 6, 2, 0, 1, 2, 8, 6, 2, 0, 3, 2, 4, 5, 6]
    mask = [0] * 9 + [1] * 3 + [0] * 10 + [1] * 3
    good = trajectory(3, 0, 1.0, mask=mask)
    evil = trajectory(3, 0, 0.0, status="max_turns", text=XSS, mask=mask)
    for t in (good, evil):
        t["token_ids"] = ids
    write_run(run, {1: [good, evil], 2: [good]})
    make_tokenizer(run / "checkpoint" / "model", [XSS])
    url, stop = serve_wsgi_in_thread(viewer.create_app([str(run)]))
    try:
        driver.get(url + "/")
        driver.find_element(By.CSS_SELECTOR, "a.run").click()
        assert len(driver.find_elements(By.CSS_SELECTOR, "svg.curve")) == 4
        driver.find_element(By.LINK_TEXT, "step 1").click()
        driver.find_element(By.LINK_TEXT, "line 2").click()
        assert driver.current_url.endswith("/run/0/step/1/traj/2")
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018 -- the injected script must not have run
        body = driver.find_element(By.TAG_NAME, "body").text
        assert (XSS in body and "task 3: reach the end" in body and "you moved" in body
                and "max_turns" in body)
        assert "decoded with the tokenizer of" in body
        sampled = driver.find_elements(By.CSS_SELECTOR, ".tokens .tok.sampled")
        context = driver.find_elements(By.CSS_SELECTOR, ".tokens .tok.context")
        assert len(sampled) == sum(mask) and len(context) == len(mask) - sum(mask)
        # pre-wrap keeps spaces
        assert [s.text for s in sampled[:3]] == [" go", " left", "<|im_end|>"]
        assert sampled[0].get_attribute("title") == "#9 id 4 mask 1 logprob -0.25"
        assert XSS in [c.text for c in context]  # the script token, shown as text
        colour = {e.value_of_css_property("background-color") for e in sampled}
        assert len(colour) == 1 and colour.isdisjoint(e.value_of_css_property("background-color")
                                                      for e in context)
        driver.save_screenshot(os.path.join(artifacts, "viewer_trajectory.png"))
        driver.back()
        driver.find_element(By.CSS_SELECTOR, "a.compare").click()
        assert len(driver.find_elements(By.CSS_SELECTOR, ".side .msg")) == 8
        driver.save_screenshot(os.path.join(artifacts, "viewer_compare.png"))
    finally:
        driver.quit()
        stop()
    assert os.path.getsize(os.path.join(artifacts, "viewer_trajectory.png")) > 1000


def test_update_kl_and_informative_groups_are_drawn_when_logged(tmp_path):
    from tools import viewer
    run = tmp_path / "r"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, "success_rate": 0.5, "update_kl": 1e-4 * step,
                                "groups_informative": 0.25}) + "\n")
    html = viewer.create_app([str(run)]).test_client().get("/run/0").get_data(as_text=True)
    assert html.count("<svg") == 6 and "update KL" in html and "informative groups" in html


def test_a_lone_surrogate_or_a_nested_line_is_shown_not_a_500(tmp_path):
    """An endpoint's reply with a lone surrogate (JSON "\\ud800", as eval.py logs it) renders with
    "?" in its place on every page; a line nested past what json parses, in a step file, in
    eval.jsonl or in metrics.jsonl, is named by its number while the page shows the rest."""
    run = write_run(tmp_path / "r", {1: [trajectory(7, 0, 1.0, text="left \ud800 now"),
                                         trajectory(7, 0, 0.0)]})
    nested = "[" * 100_000 + "]" * 100_000 + "\n"
    with open(os.path.join(run, "rollouts", "step_000001.jsonl"), "a") as f:
        f.write(nested)
    with open(os.path.join(run, "eval.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "success_rate": 0.5, "tasks": 2}) + "\n" + nested)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(nested)
    c = viewer.create_app([str(run)]).test_client()
    for url in ("/run/0/step/1/traj/1", "/run/0/step/1/compare?a=1&b=2"):
        r = c.get(url)
        assert r.status_code == 200 and "left ? now" in r.get_data(as_text=True), url
    page = c.get("/run/0/step/1").get_data(as_text=True)
    assert "2 trajectories match" in page and "1 unreadable lines: 3" in page
    r = c.get("/run/0")
    assert r.status_code == 200
    text = r.get_data(as_text=True)
    assert "metrics.jsonl: 1 unreadable lines: 2" in text and "eval.jsonl: 1 unreadable" in text
    r = c.get("/run/0/step/1/traj/3")
    assert r.status_code == 422 and "nested too deep" in r.get_data(as_text=True)
    assert c.get("/").status_code == 200
