"""The front door stays short and every link in it and in docs/ leads somewhere.

* README.md: at most 200 lines; dated results only in its one results table (a heading that says "Results"), which
  links to docs/experiments.md, the lab notebook; no ISO date and no table of figures anywhere else in it.
* README.md and docs/*.md: every relative link names a file that exists, and an anchor names a heading of that
  file, slugged as GitHub slugs headings (lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats).
* docs/README.md, the index of docs/, links every docs/*.md.

Plain text parsing, no services: a fraction of a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
INDEX = DOCS / "README.md"
NOTEBOOK = "docs/experiments.md"
MAX_README_LINES = 200

ISO_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# A table cell that starts with a figure: 0.236, +7.1, −4.2, 39–48, **+6.6**, 95%.
FIGURE_CELL = re.compile(r"^\**[+−-]?\d")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked unless `blank_code` is false."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"(`+).*?\1", "``", line) if blank_code else line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text.

    >>> github_slug("From a clean clone on an AMD EPYC machine with AVX-512, 2026-12-04: five seeds")
    'from-a-clean-clone-on-an-amd-epyc-machine-with-avx-512-2026-12-04-five-seeds'
    >>> github_slug("Measured: the recipe with terminus-2 and `model=tiny_terminus` (2026-12-06)")
    'measured-the-recipe-with-terminus-2-and-modeltiny_terminus-2026-12-06'
    >>> github_slug("[Task filter](#x) → *GRPO*")
    'task-filter--grpo'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")  # HTML tags; code spans keep their text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a markdown file offers: its headings' slugs (repeats numbered) and explicit <a name|id>."""
    seen: dict[str, int] = {}
    found = set()
    text = path.read_text()
    for _, line in prose_lines(text, blank_code=False):  # a heading's code spans are part of its slug
        if m := HEADING.match(line):
            slug = github_slug(m.group(2))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found | set(HTML_ANCHOR.findall(text))


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline, image and reference link outside code."""
    found = []
    for number, line in prose_lines(path.read_text()):
        found += [(number, target) for target in LINK.findall(line)]
        if m := REFERENCE.match(line):
            found.append((number, m.group(1)))
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each link of `path` that names a missing file, a path outside `root` (the repository), or a missing heading."""
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: … are not checked here
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{number}: ({target})"
        if file_part.startswith("/"):
            broken.append(f"{where} an absolute path; link relative to the file")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        if root not in dest.parents and dest != root:
            broken.append(f"{where} points outside the repository")
        elif not dest.exists():
            broken.append(f"{where} no such file {dest.relative_to(root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def tables(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Markdown tables: runs of lines that start with '|'."""
    found, current = [], []
    for number, line in [*lines, (0, "")]:
        if line.lstrip().startswith("|"):
            current.append((number, line))
        elif current:
            found.append(current)
            current = []
    return found


def figure_table(table: list[tuple[int, str]]) -> bool:
    """A table of results: a body cell (after the header and its rule) starts with a figure, or a date appears."""
    cells = [cell.strip() for _, row in table[2:] for cell in row.strip().strip("|").split("|")]
    return any(FIGURE_CELL.match(cell) for cell in cells) or any(ISO_DATE.search(row) for _, row in table)


def results_section(lines: list[tuple[int, str]]) -> tuple[int, int]:
    """The line span [start, end) of the README's one section whose heading says Results."""
    spans = []
    for i, (number, line) in enumerate(lines):
        m = HEADING.match(line)
        if m and "results" in m.group(2).lower():
            level = len(m.group(1))
            end = next(
                (n for n, later in lines[i + 1 :] if (h := HEADING.match(later)) and len(h.group(1)) <= level),
                10**9,
            )
            spans.append((number, end))
    assert len(spans) == 1, f"README.md needs one section headed 'Results' (found {len(spans)})"
    return spans[0]


def readme_problems(text: str) -> list[str]:
    """What keeps the README from being the short front door the project promised (issue #45)."""
    problems = []
    n_lines = len(text.splitlines())
    if n_lines > MAX_README_LINES:
        problems.append(f"README.md has {n_lines} lines (at most {MAX_README_LINES}): move detail to docs/")
    lines = prose_lines(text)
    try:
        start, end = results_section(lines)
    except AssertionError as err:
        problems.append(str(err).splitlines()[0])
        start = end = 0  # no Results section: every line is outside it
    inside = [(n, line) for n, line in lines if start <= n < end]
    outside = [(n, line) for n, line in lines if not start <= n < end]
    results = [t for t in tables(inside) if figure_table(t)]
    if inside and len(results) != 1:
        problems.append(f"the Results section holds {len(results)} tables of figures (one, small)")
    if inside and not any(ISO_DATE.search(line) for _, line in inside):
        problems.append("the Results section does not say when its table was measured (an ISO date)")
    if inside and not any(NOTEBOOK in line for _, line in inside):
        problems.append(f"the Results section does not link the lab notebook, {NOTEBOOK}")
    for table in tables(outside):
        if figure_table(table):
            problems.append(f"README.md:{table[0][0]}: a table of results outside Results: it belongs in {NOTEBOOK}")
    for number, line in outside:
        if date := ISO_DATE.search(line):
            problems.append(
                f"README.md:{number}: a dated result ({date.group()}) outside Results: move it to {NOTEBOOK}"
            )
    return problems


def test_the_readme_is_short_with_one_dated_results_table():
    problems = readme_problems(README.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_to_a_file_and_heading(path):
    broken = broken_links(path)
    assert not broken, "\n".join(broken)


def test_the_docs_index_lists_every_doc():
    assert INDEX.exists(), "docs/README.md, the index of docs/, is missing"
    listed = {(INDEX.parent / target.partition("#")[0]).resolve() for _, target in links(INDEX)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p != INDEX and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not list: {', '.join(missing)} (one line each)"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The checks above, on planted faults: a long README, a second dated table, a broken link and anchor."""
    assert github_slug("`model=tiny_terminus` (2026-12-06)") == "modeltiny_terminus-2026-12-06"
    assert github_slug("[Task filter](#x) → *GRPO*") == "task-filter--grpo"
    table = "| seeds | gain |\n|---|---|\n| 39–53 | +6.6 |\n"
    good = f"# t\n\n## Results\n\nOn 2026-12-06 ([notebook]({NOTEBOOK})):\n\n{table}\n## Commands\n\n| a | b |\n|---|---|\n| `x` | y |\n"
    assert readme_problems(good) == []
    assert any("lines" in p for p in readme_problems(good + "\n" * 200))
    assert any("outside Results" in p for p in readme_problems(good + "\n## More\n\n" + table))
    assert any("2026-12-05" in p for p in readme_problems(good + "\nOn 2026-12-05 it gained more.\n"))
    assert any("one section" in p for p in readme_problems("# t\n"))

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words (2026-12-06)\n\n## Two words (2026-12-06)\n")
    doc = tmp_path / "README.md"
    ok = "[a](docs/a.md) [b](docs/a.md#two-words-2026-12-06-1) [c](#t) [d](https://x.org/missing) `[e](nowhere.md)`"
    doc.write_text(f"# T\n\n{ok}\n")
    assert broken_links(doc, tmp_path) == []
    doc.write_text("# T\n\n[a](docs/b.md) [b](docs/a.md#two-words) [c](#u) [d](../../x.md)\n")
    assert [p.split(") ", 1)[1] for p in broken_links(doc, tmp_path)] == [
        "no such file docs/b.md",
        "no heading #two-words in docs/a.md",
        "no heading #u in README.md",
        "points outside the repository",
    ]
