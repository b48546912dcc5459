"""The documentation holds together: the README stays a guide one reads in minutes (at most 20 KB), and
every relative link and image path in README.md and docs/*.md names a file that exists."""

import glob
import os
import re

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
MAX_README_BYTES = 20_480

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.S | re.M)  # fenced code blocks
CODE = re.compile(r"(`+).+?\1", re.S)  # inline code spans
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)")  # [text](target), ![alt](target)
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


def test_the_readme_is_at_most_20_kb():
    size = os.path.getsize(README)
    assert size <= MAX_README_BYTES, (
        f"README.md is {size:,} bytes, over {MAX_README_BYTES:,}: move detail into a docs/ page and link it")


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
    text = ("See [the page](docs/a.md#part) and ![a plot](b.png \"title\"), [web](https://x.org/c.md), "
            "[here](#anchor), `[not](code.md)` and <img src=\"d.png\">.\n\n```\n[nor](fenced.md)\n```\n"
            "[ref]: e.md\n")
    assert relative_targets(text) == ["docs/a.md", "b.png", "e.md", "d.png"]
