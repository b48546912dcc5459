"""SearchQA (Deep Search): answer a question by searching a passage corpus, Search-R1 style.

The game of Search-R1 (Jin et al., 2025) as AgentGym serves it (agentenv-searchqa), re-implemented.
An action is the first `<search>..</search>` or `<answer>..</answer>` block of the agent's reply:

    <search>query</search>  -> "<information>Doc 1(Title: "T") text\\nDoc 2(...) ...</information>"
                               (top-k)
    <answer>text</answer>   -> right: "Congratulations! ..." with reward 1, done;
                               wrong: "Sorry, your answer is incorrect. Please try again.",
                               reward 0, not done
    anything else           -> "Your previous action is invalid. ..." (upstream's hint), reward 0

An answer is right when it equals one of the gold answers after SQuAD's normalisation (lower case,
no punctuation, no articles a/an/the, single spaces), as Search-R1's exact-match reward. The first
observation is a short how-to-play note (this project's wording) ending in "Question: ...". Passages
render as Search-R1's `_passages2string`: the corpus stores a passage as `"Title"\\ntext` and shows
it as `Doc i(Title: "Title") text`, one per line.

Retrieval: BM25 (the `bm25s` library, CPU) over a local JSONL corpus ({"id", "title", "text"}, or
Search-R1's {"id", "contents"}), indexed once and cached on disk under a key of the corpus file's
path, size and mtime; or, with `--retriever-url`, any server speaking Search-R1's `POST /retrieve`
(its e5 dense index over Wikipedia, on a GPU). Questions: FlashRAG-style JSONL ({"question",
"golden_answers", "data_source"}, optionally "id" and the expert's "hops"); task ids in the order
the files are given, rows in file order. The shipped world is made up (env_server/searchqa_data.py
writes it): 288 pages about invented people, towns, companies and inventions, 180 one-hop and 180
two-hop questions.

Departures from upstream:
- the env stops an episode after `--max-steps` actions (30, upstream's evaluation horizon; its
  server has no limit of its own, its trainer stops at 5-10 rounds);
- the first tag block is the action, also for scoring (upstream scores the last <answer> of the
  reply; this project's client sends only the first block, so both read the same answer);
- a step after done, a bad task id or a non-string action is an error (upstream: undefined);
- BM25 on CPU instead of e5 + FAISS; a search that matches no indexed word returns no passages
  (Pyserini's BM25 does the same), rendered "<information></information>".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import string
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass

import bm25s
import numpy as np

from .base import Env, StepResult, TaskError

log = logging.getLogger("env_server.searchqa")
# bm25s sets its own logger to DEBUG: chatty in server logs
logging.getLogger("bm25s").setLevel(logging.WARNING)

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CORPUS_PATH = os.path.join(DATA_DIR, "searchqa_corpus.jsonl")
QA_PATH = os.path.join(DATA_DIR, "searchqa_qa.jsonl")
DEFAULT_INDEX_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                 "agentgym-rl-mini", "searchqa")
TOPK = 3  # upstream's SEARCHQA_RETRIEVAL_TOPK
MAX_STEPS = 30  # upstream's evaluation max_rounds for searchqa
# the split rule: row k of each data source (counting from 0) is a test task when k % 5 == 0
TEST_EVERY = 5
# part of the cache key: the tokenizer's settings
INDEX_VERSION = f"bm25s-{bm25s.__version__}-lower-en-stopwords"

# Upstream's texts, verbatim: agents trained on its transcripts have seen exactly these.
PROMPT = (
    "Think inside <think>...</think> before every move. When you are missing a fact, write one "
    "<search>query</search> and stop there: the passages it finds come back inside "
    "<information>...</information>. Never write <information> yourself. Search as often as you "
    "need; once you are sure, give a short final answer inside <answer>...</answer>, e.g. <answer> "
    "Paris </answer>.\n\nQuestion: {question}")
CORRECT = "Congratulations! You have answered the question correctly."
WRONG = "Sorry, your answer is incorrect. Please try again."
INVALID = ("Your previous action is invalid. If you want to search, you should put the query "
           "between <search> and </search>. If you want to give the final answer, you should put "
           "the answer between <answer> and </answer>. Please try again.")

_OPEN_TAG = re.compile(r"<(search|answer)>")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NO_PUNCT = str.maketrans("", "", string.punctuation)


# --------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """SQuAD's normalisation, in Search-R1's order: lower case, drop punctuation, drop articles,
    then collapse whitespace. "The Essel-River!" -> "esselriver"."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_NO_PUNCT)).split())


def exact_match(prediction: str, golden_answers) -> bool:
    """Search-R1's `em_check`: the normalised prediction equals one normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golden_answers)


def first_tag(action: str) -> tuple[str, str] | None:
    """(tag, text) of the first `<search>..</search>` or `<answer>..</answer>` block, or None.

    Upstream's `re.search(r"<(search|answer)>(.*?)</\\1>", action, re.DOTALL)`, in linear time: that
    pattern rescans the rest of the text from every opening tag, 8 s of CPU for "<search>" * 12500.
    """
    last_close = {tag: action.rfind(f"</{tag}>") for tag in ("search", "answer")}
    for m in _OPEN_TAG.finditer(action):
        tag = m[1]
        if last_close[tag] >= m.end():  # a closing tag follows: this opening is the first match
            return tag, action[m.end():action.find(f"</{tag}>", m.end())]
    return None


# --------------------------------------------------------------------------------------------------
# Corpus and retrieval
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Passage:
    doc_id: str
    contents: str  # '"Title"\ntext', the form Search-R1's corpus stores
    score: float


def format_passages(passages: list[Passage]) -> str:
    """Search-R1's `_passages2string`: the first line of a passage is its title, the rest its
    text."""
    out = []
    for i, p in enumerate(passages, 1):
        title, _, text = p.contents.partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


def read_corpus(path: str) -> tuple[list[str], list[str]]:
    """(ids, contents) of a JSONL corpus: {"id", "title", "text"} or Search-R1's {"id",
    "contents"}."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--corpus: no such file: {path}")
    ids, contents = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "contents" in row:
                    text = row["contents"]
                else:  # quoted, as in Search-R1's wiki-18 corpus, so both render alike
                    text = f'"{row["title"]}"\n{row["text"]}'
                if not isinstance(text, str):
                    raise TypeError("contents/title/text must be strings")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--corpus {path}:{lineno}: need {{\"id\", \"title\", \"text\"}} "
                                 f"or {{\"id\", \"contents\"}} ({type(e).__name__}: {e})") from None
            ids.append(str(row.get("id", len(ids))))
            contents.append(text)
    if not ids:
        raise ValueError(f"--corpus {path}: no passages")
    return ids, contents


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class BM25Index:
    """BM25 over a local corpus file, built once and cached in `index_dir/<file>-<key>/`, where the
    key hashes the file's absolute path, size and mtime and the tokenizer's settings: an edited
    corpus gets a new index, an unchanged one is loaded (`built` False) instead of rebuilt."""

    def __init__(self, corpus_path: str, index_dir: str):
        self.ids, self.contents = read_corpus(corpus_path)
        st = os.stat(corpus_path)
        key = f"{os.path.abspath(corpus_path)}|{st.st_size}|{st.st_mtime_ns}|{INDEX_VERSION}"
        stem = os.path.splitext(os.path.basename(corpus_path))[0]
        self.path = os.path.join(index_dir, f"{stem}-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
        t0 = time.perf_counter()
        self.bm25 = self._load()
        self.built = self.bm25 is None
        if self.built:
            self.bm25 = bm25s.BM25()
            self.bm25.index(_tokenize(self.contents), show_progress=False)
            self._save()
        self.load_s = time.perf_counter() - t0

    def _load(self):
        if not os.path.isfile(os.path.join(self.path, "params.index.json")):
            return None
        bm25 = bm25s.BM25.load(self.path, show_progress=False)
        # a damaged cache: rebuild rather than misanswer
        if bm25.scores["num_docs"] != len(self.ids):
            log.warning("cached BM25 index %s has %d docs, the corpus %d: rebuilding", self.path,
                        bm25.scores["num_docs"], len(self.ids))
            return None
        return bm25

    def _save(self) -> None:
        # Written to a temporary folder and renamed, so a concurrent server never reads half an
        # index.
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
            self.bm25.save(tmp, show_progress=False)
            if os.path.isdir(self.path):  # a stale or damaged one (or another process was faster)
                shutil.rmtree(self.path, ignore_errors=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot cache the BM25 index in %s (%s): it will be rebuilt at the next "
                        "start", parent, e)

    def search(self, query: str, k: int) -> list[Passage]:
        # words not in the corpus drop out
        token_ids = self.bm25.get_tokens_ids(_tokenize([query])[0])
        if not token_ids:
            return []
        scores = self.bm25.get_scores_from_ids(token_ids)  # (N,)
        top = np.argpartition(-scores, k - 1)[:k] if len(scores) > k else np.arange(len(scores))
        # best first; ties by corpus order
        top = sorted(top.tolist(), key=lambda i: (-scores[i], i))
        return [Passage(self.ids[i], self.contents[i], float(scores[i])) for i in top
                if scores[i] > 0]


class RetrievalError(RuntimeError):
    """The remote retriever failed or answered something unreadable (the server reports a 500)."""


class RemoteRetriever:
    """A retrieval server with Search-R1's API (search_r1/search/retrieval_server.py):
    POST url {"queries": [q], "topk": k, "return_scores": true}
      -> {"result": [[{"document": {"id", "contents"}, "score"}, ...]]}  (one list per query)."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--retriever-url must be an http(s) URL such as "
                             f"http://127.0.0.1:8000/retrieve, got {url!r}")
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def search(self, query: str, k: int) -> list[Passage]:
        body = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body,
                                     headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
                break
            # the server answered: retrying will not change its mind
            except urllib.error.HTTPError as e:
                raise RetrievalError(f"retriever {self.url} answered HTTP {e.code}: "
                                     f"{e.read()[:200]!r}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise RetrievalError(f"retriever {self.url} unreachable after {attempt + 1} "
                                         f"tries: {e}") from None
                time.sleep(0.2 * 2 ** attempt)
        try:
            items = json.loads(raw)["result"][0]
            out = []
            # with return_scores the document is wrapped; without it, it is the item
            for item in items:
                doc = item["document"] if "document" in item else item
                contents = (doc["contents"] if "contents" in doc
                            else f'"{doc["title"]}"\n{doc["text"]}')
                out.append(Passage(str(doc.get("id", "")), str(contents),
                                   float(item.get("score", 0.0))))
            return out[:k]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RetrievalError(f"retriever {self.url} answered an unreadable result "
                                 f"({type(e).__name__}: {e}): {raw[:200]!r}") from None


# --------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hop:
    query: str  # the search the expert makes
    doc: str | None  # the id of the passage that answers it (None where the data does not say)


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    answers: tuple[str, ...]
    source: str  # data_source: the task's category
    hops: tuple[Hop, ...]


def read_questions(specs: list[str]) -> tuple[list[Question], dict[str, list[int]]]:
    """Questions and train/test ids from `--qa` specs: `PATH`, `train=PATH` or `test=PATH`. Ids
    follow the specs' order, then file order. A prefixed file goes whole into that split; rows of a
    plain file follow the rule: per data source, every TEST_EVERY-th row (the 0th, 5th, ...) is a
    test task."""
    questions: list[Question] = []
    splits: dict[str, list[int]] = {"train": [], "test": []}
    seen_per_source: Counter = Counter()
    for spec in specs:
        split, path = spec.split("=", 1) if spec.startswith(("train=", "test=")) else (None, spec)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--qa: no such file: {path}")
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    q = _question(json.loads(line), f"{os.path.basename(path)}:{lineno}",
                                  os.path.splitext(os.path.basename(path))[0])
                except KeyError as e:
                    raise ValueError(f"--qa {path}:{lineno}: missing field {e}") from None
                except (ValueError, TypeError, AttributeError) as e:
                    raise ValueError(f"--qa {path}:{lineno}: {e}") from None
                if split is None:
                    part = "test" if seen_per_source[q.source] % TEST_EVERY == 0 else "train"
                    seen_per_source[q.source] += 1
                else:
                    part = split
                splits[part].append(len(questions))
                questions.append(q)
    if not questions:
        raise ValueError(f"--qa {' '.join(specs)}: no questions")
    return questions, splits


def _question(row: dict, where: str, default_source: str) -> Question:
    question = row["question"]
    answers = row["golden_answers"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError("'golden_answers' must be a non-empty list of strings")
    hops = tuple(Hop(h["query"], h.get("doc")) for h in row.get("hops", ()))
    if not all(isinstance(h.query, str) for h in hops):
        raise ValueError("each of 'hops' needs a string 'query'")
    if not hops:  # data without the expert's route: it searches the question itself, then answers
        hops = (Hop(question.strip(), None),)
    return Question(str(row.get("id", where)), question.strip(), tuple(answers),
                    str(row.get("data_source", default_source)), hops)


# --------------------------------------------------------------------------------------------------
# World: questions, splits and the retriever; built once per process, read-only afterwards
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    questions: tuple[Question, ...]
    splits: dict
    retriever: BM25Index | RemoteRetriever
    topk: int
    max_steps: int


class SearchQAEnv(Env):
    name = "searchqa"
    # AgentGym's SearchQA client reads a bare id from /create and a bare /reset (app.py)
    bare_answers = True
    batch_threads = 8  # /batch steps instances in parallel: a remote retriever waits on the network

    @staticmethod
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--corpus", default=None, metavar="PATH",
                            help="JSONL passages {id, title, text} or {id, contents} to index with "
                                 "BM25; default: the shipped made-up corpus")
        parser.add_argument("--qa", nargs="+", default=None, metavar="[SPLIT=]PATH",
                            help="JSONL questions {question, golden_answers, data_source}; task "
                                 "ids follow the order given; 'train=PATH'/'test=PATH' put a whole "
                                 f"file in a split, a plain PATH sends every {TEST_EVERY}th "
                                 "question of each data source to test; default: the shipped "
                                 "made-up questions")
        parser.add_argument("--retriever-url", default=None, metavar="URL",
                            help="search with a Search-R1 retrieval server (e.g. "
                                 "http://127.0.0.1:8000/retrieve) instead of local BM25")
        parser.add_argument("--index-dir", default=None, metavar="DIR",
                            help=f"where BM25 indexes are cached (default: {DEFAULT_INDEX_DIR})")
        parser.add_argument("--topk", type=int, default=TOPK,
                            help="passages per search (default: %(default)s)")
        parser.add_argument("--max-steps", type=int, default=MAX_STEPS,
                            help="actions before an episode ends unanswered (default: %(default)s)")

    @classmethod
    def load_world(cls, args: argparse.Namespace | None = None) -> World:
        corpus, url = getattr(args, "corpus", None), getattr(args, "retriever_url", None)
        topk, max_steps = getattr(args, "topk", TOPK), getattr(args, "max_steps", MAX_STEPS)
        if topk < 1:
            raise ValueError(f"--topk must be at least 1, got {topk}")
        if max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {max_steps}")
        if corpus and url:
            raise ValueError("--corpus and --retriever-url exclude each other: a retrieval server "
                             "searches its own corpus")
        qa = getattr(args, "qa", None) or [QA_PATH]
        questions, splits = read_questions([qa] if isinstance(qa, str) else list(qa))
        if url:
            retriever = RemoteRetriever(url)
        else:
            retriever = BM25Index(corpus or CORPUS_PATH, getattr(args, "index_dir", None)
                                  or DEFAULT_INDEX_DIR)
            log.info("BM25 index %s %s in %.2f s", retriever.path,
                     "built" if retriever.built else "loaded", retriever.load_s)
        return World(tuple(questions), splits, retriever, topk, max_steps)

    @classmethod
    def num_tasks(cls, world: World) -> int:
        return len(world.questions)

    @classmethod
    def task_category(cls, world: World, idx: int) -> str:
        return world.questions[idx].source

    def __init__(self, world: World):
        super().__init__(world)
        self.idx: int | None = None
        self.q: Question | None = None
        self.done = False
        self.reward = 0.0  # the last step's
        self.steps = 0
        self.last_observation = ""
        self.searches: list[str] = []  # queries made this episode, in order
        self.seen_docs: set[str] = set()  # ids of every passage shown this episode

    def reset(self, idx: int) -> str:
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise TaskError(f"task id must be an integer, got {idx!r}")
        if not 0 <= idx < len(self.world.questions):
            raise TaskError(f"task id {idx} out of range 0..{len(self.world.questions) - 1}", 404)
        self.idx, self.q = idx, self.world.questions[idx]
        self.done, self.reward, self.steps = False, 0.0, 0
        self.searches, self.seen_docs = [], set()
        self.last_observation = PROMPT.format(question=self.q.question)
        return self.last_observation

    def step(self, action: str) -> StepResult:
        if self.q is None:
            raise TaskError("no task: call reset first", 409)
        if self.done:
            raise TaskError("the episode is done: call reset to start another", 409)
        if not isinstance(action, str):
            raise TaskError(f"action must be a string, got {type(action).__name__}")
        reward, info = 0.0, {}
        block = first_tag(action)
        if block is None:
            observation = INVALID
        elif block[0] == "search":
            query = block[1].strip()
            passages = self.world.retriever.search(query, self.world.topk)
            self.searches.append(query)
            self.seen_docs.update(p.doc_id for p in passages)
            observation = f"<information>{format_passages(passages).strip()}</information>"
        elif exact_match(block[1].strip(), self.q.answers):
            observation, reward, self.done = CORRECT, 1.0, True
        else:
            observation = WRONG
        self.steps += 1
        if not self.done and self.steps >= self.world.max_steps:
            self.done, info["truncated"] = True, True
        self.reward, self.last_observation = reward, observation
        return StepResult(observation, reward, self.done, info=info)

    def observation(self) -> str:
        """The latest observation (the question prompt right after reset), as upstream's
        /observation."""
        if self.q is None:
            raise TaskError("no task: call reset first", 409)
        return self.last_observation

    def available_actions(self) -> list[str]:
        return ["<search>query</search>", "<answer>answer</answer>"]

    def detail(self) -> dict:
        if self.q is None:
            return {"task_id": None, "done": False}
        return {
            "task_id": self.idx,
            "qid": self.q.qid,
            "question": self.q.question,
            "category": self.q.source,
            "golden_answers": list(self.q.answers),
            "searches": list(self.searches),
            "observation": self.last_observation,
            "steps": self.steps,
            "max_steps": self.world.max_steps,
            "reward": self.reward,
            "done": self.done,
        }

    def expert_action(self) -> str | None:
        """Search the next hop whose page has not been shown yet (nor searched for: a failed search
        is not repeated), then answer with the first gold answer. None once done or before reset."""
        if self.q is None or self.done:
            return None
        for hop in self.q.hops:
            if hop.doc not in self.seen_docs and hop.query not in self.searches:
                return f"<search>{hop.query}</search>"
        return f"<answer>{self.q.answers[0]}</answer>"


def main() -> None:
    """`python -m env_server.searchqa [flags]`: the world's sizes, the index time, the expert's
    recall."""
    parser = argparse.ArgumentParser(description="SearchQA world tools")
    SearchQAEnv.add_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world = SearchQAEnv.load_world(args)
    by_source = Counter(q.source for q in world.questions)
    print(f"{len(world.questions)} questions {dict(sorted(by_source.items()))}; "
          f"train {len(world.splits['train'])}, test {len(world.splits['test'])}")
    hops = [h for q in world.questions for h in q.hops if h.doc is not None]
    if hops:
        t0 = time.perf_counter()
        found = sum(h.doc in {p.doc_id for p in world.retriever.search(h.query, world.topk)}
                    for h in hops)
        ms = (time.perf_counter() - t0) / len(hops) * 1e3
        print(f"expert's searches: gold page in the top {world.topk} for {found}/{len(hops)}; "
              f"{ms:.2f} ms per search")


if __name__ == "__main__":
    main()
