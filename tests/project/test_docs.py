"""The user docs (README.md and docs/) stay usable: every relative link and every anchor
resolves, and the pages describe the software, not how it was built.

Anchors follow GitHub's heading slugs: lower case, punctuation other than ``-`` and ``_``
dropped, spaces to ``-``, a repeated heading numbered ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("**/*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# a diary, not a reference: work periods, locks, clock windows, machine load, tracker numbers
DIARY = re.compile(
    r"session [0-9]|this session|helpers?\b|quiet lock|[0-9]{2}:[0-9]{2}(-[0-9]{2}:[0-9]{2})? UTC"
    r"|load average|issue [0-9]",
    re.I,
)


def slugs(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_links_are_found_and_anchors_are_checked():
    """The checker itself: it sees a known link and rejects a made-up anchor."""
    readme = ROOT / "README.md"
    assert "docs/benchmarks.md" in {t.partition("#")[0] for t in links(readme)}
    assert "multi-turn-chat-sharegpt" in slugs(ROOT / "docs" / "benchmarks.md")
    assert "no-such-heading" not in slugs(ROOT / "docs" / "benchmarks.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_describe_the_software_not_its_making(page):
    hits = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if DIARY.search(line)
    ]
    assert not hits, f"{page.name}: " + "; ".join(hits)


def test_every_figure_in_docs_is_shown_by_a_page():
    shown = {(p.parent / t).resolve() for p in PAGES for t in links(p) if t.endswith(".png")}
    figures = set((ROOT / "docs").glob("**/*.png"))
    assert figures <= shown, f"figures no page shows: {sorted(map(str, figures - shown))}"
    assert not list((ROOT / "docs").glob("**/*.log")), "raw logs belong in git history"


def test_every_benchmark_script_is_listed_in_the_benchmarks_readme():
    """A runnable script under benchmarks/ (one with a ``__main__`` block) has its row in
    benchmarks/README.md: what it measures, its command, where its figure is published."""
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [
        p.relative_to(ROOT / "benchmarks").as_posix()
        for p in sorted((ROOT / "benchmarks").glob("*/*.py"))
        if '__name__ == "__main__"' in p.read_text()
    ]
    assert scripts, "no benchmark scripts found"
    missing = [s for s in scripts if f"`{s}`" not in listed]
    assert not missing, f"not in benchmarks/README.md: {missing}"
