"""The documentation holds together: the README stays a guide one reads in minutes (at most 15 KB),
docs/ a user guide (at most 60 KB of pages, 8 pictures, a results page of at most 15 KB), and every
relative link and image path in README.md and docs/*.md names a file that exists."""

import glob
import os
import re

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
MAX_README_BYTES = 15_000
# docs/*.md (plans included), docs/results.md, docs/*.png: a guide, not a diary (git keeps the rest)
MAX_DOCS_BYTES, MAX_RESULTS_BYTES, MAX_PICTURES = 60_000, 15_000, 8

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.S | re.M)  # fenced code blocks
CODE = re.compile(r"(`+).+?\1", re.S)  # inline code spans
# [text](target), ![alt](target)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)  # [label]: target
HTML = re.compile(r"""<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.I)


def doc_files() -> list[str]:
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def relative_targets(text: str) -> list[str]:
    """The link and image targets of a Markdown text that name a local file (code left out)."""
    text = CODE.sub("", FENCE.sub("", text))
    found = INLINE.findall(text) + REFERENCE.findall(text) + HTML.findall(text)
    out = []
    for target in found:
        target = target.strip("<>")
        if not target or target.startswith("#") or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # an anchor on the same page, or a URL (http:, https:, mailto:, ...)
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


def test_docs_is_a_guide_not_a_notebook():
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    total = sum(os.path.getsize(p) for p in pages)
    assert total <= MAX_DOCS_BYTES, f"docs/*.md hold {total:,} bytes, over {MAX_DOCS_BYTES:,}"
    results = os.path.getsize(os.path.join(ROOT, "docs", "results.md"))
    assert results <= MAX_RESULTS_BYTES, (
        f"docs/results.md is {results:,} bytes: one table per result")
    pictures = glob.glob(os.path.join(ROOT, "docs", "*.png"))
    assert len(pictures) <= MAX_PICTURES, f"{len(pictures)} pictures in docs/"
    used = "".join(open(p, encoding="utf-8").read() for p in doc_files())
    unused = [os.path.basename(p) for p in pictures if os.path.basename(p) not in used]
    assert not unused, f"pictures no page shows: {unused}"


def test_the_readme_is_at_most_15_kb():
    size = os.path.getsize(README)
    assert size <= MAX_README_BYTES, (
        f"README.md is {size:,} bytes, over {MAX_README_BYTES:,}: move detail into a docs/ page "
        f"and link it")


def test_every_relative_link_and_image_resolves():
    broken = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            targets = relative_targets(f.read())
        for target in targets:
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_finder_sees_links_and_skips_urls_anchors_and_code():
    text = ("See [the page](docs/a.md#part) and ![a plot](b.png \"title\"), "
            "[web](https://x.org/c.md), "
            "[here](#anchor), `[not](code.md)` and <img src=\"d.png\">.\n\n"
            "```\n[nor](fenced.md)\n```\n"
            "[ref]: e.md\n")
    assert relative_targets(text) == ["docs/a.md", "b.png", "e.md", "d.png"]


TOUR_ROW = re.compile(r"^\| [^|]+ \| \[([\w/.]+\.py):(\d+)\]\(([\w/.]+\.py)#L(\d+)\) `([^`]+)` \|")


def test_the_readmes_tour_points_at_the_lines_it_quotes():
    """Each row of the reading path's table names file:line and quotes that line: the line must
    still hold the quote (line numbers move as the code does)."""
    rows = [TOUR_ROW.match(x) for x in open(README, encoding="utf-8")]
    rows = [r for r in rows if r]
    assert len(rows) >= 10, "the reading path's table is gone"
    wrong = []
    for r in rows:
        path, line, link, link_line, quote = r.groups()
        lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
        at = [i + 1 for i, x in enumerate(lines) if quote in x]
        if path != link or line != link_line or int(line) not in at:
            wrong.append(f"{path}:{line} `{quote}` (found at {at})")
    assert not wrong, f"the README's tour is out of date: {wrong}"
