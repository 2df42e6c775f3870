"""The README and docs/ point only at things that exist.

- every relative link (`[text](path)`, `![alt](path)`, `[text](#heading)`) resolves to a file or
  folder of the repository, and a link into a markdown file with `#anchor` to one of its headings;
- every repository path named in backticks outside code blocks (`benchmarks/foo.py`,
  `experiments/x/`, `config/schema.py` under src/prmppo) exists; a path with a placeholder
  (`src/prmppo/tasks/<name>.py`) must exist up to the placeholder.

Paths count when their first part is one of the repository's own folders, or a subpackage of
src/prmppo followed by a file or a folder (`config/schema.py`, the way the docs name modules; not a
metric such as `rollout/engine_logprob_abs_diff`); run outputs (`runs/`, `artifacts/`) and
environments (`.venv-vllm/`) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# folders at the top of the repository that a document may name
TOP_FOLDERS = ("src", "conf", "tests", "benchmarks", "experiments", "scripts", "notebooks", "docs", ".ci")

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
PLACEHOLDER = re.compile(r"[<>*{}$]")


def prose(text: str) -> str:
    """The markdown without its fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def broken_links(doc: Path, repo: Path) -> list[str]:
    """The relative links of `doc` that point at nothing, each with what is missing."""
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            continue  # http(s)://, mailto:, or an absolute path: not the repository's
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists() or repo.resolve() not in (dest, *dest.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading #{anchor}")
    return broken


def named_paths(doc: Path, repo: Path) -> list[str]:
    """The repository paths `doc` names in backticks outside code blocks, as written."""
    package = repo / "src" / "prmppo"
    subpackages = {p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")} \
        if package.is_dir() else set()
    found = []
    for span in CODE_SPAN.findall(prose(doc.read_text())):
        for token in span.split():
            token = token.split("=", 1)[-1].strip("'\"(),;:")  # hydra.run.dir=runs/x -> runs/x
            first, last = token.split("/", 1)[0], token.rsplit("/", 1)[-1]
            if "/" not in token:
                continue
            # a module path under src/prmppo names a file or a folder (`dist/shard.py`, `rollout/`); without
            # either it is a metric's namespace (`rollout/engine_logprob_abs_diff`)
            if first in TOP_FOLDERS or (first in subpackages and (last == "" or "." in last)):
                found.append(token)
    return found


def missing_paths(doc: Path, repo: Path) -> list[str]:
    """The paths of `named_paths` that do not exist (checked up to a placeholder such as `<name>`)."""
    package = repo / "src" / "prmppo"
    missing = []
    for token in named_paths(doc, repo):
        parts = token.rstrip("/").split("/")
        kept = []
        for part in parts:
            if PLACEHOLDER.search(part):
                break
            kept.append(part)
        base = repo if parts[0] in TOP_FOLDERS else package
        if not (base / Path(*kept)).exists():
            missing.append(token)
    return missing


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc, REPO) == []


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_named_in_backticks_exists(doc):
    assert missing_paths(doc, REPO) == []


def test_the_readme_is_checked_and_links_the_docs():
    """The checks above see the README's links and paths (an empty parse would pass them vacuously)."""
    readme = REPO / "README.md"
    targets = LINK.findall(prose(readme.read_text()))
    assert {f"docs/{p.name}" for p in DOC_FILES[1:]} <= set(targets)
    assert "benchmarks/RESULTS.md" in targets
    assert "src/prmppo/config/schema.py" in named_paths(readme, REPO)


def test_the_checks_report_a_broken_link_a_missing_heading_and_a_missing_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "here.py").write_text("")
    (tmp_path / "src" / "prmppo" / "ppo").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some `code` (here)\n")
    doc = tmp_path / "README.md"
    doc.write_text("[ok](docs/a.md#some-code-here) [gone](docs/b.md) [no heading](docs/a.md#nope)\n"
                   "[self](#readme) [web](https://example.org/x.md)\n\n# README\n\n"
                   "`benchmarks/here.py` `python benchmarks/gone.py --x` `benchmarks/<name>.py` "
                   "`experiments/<study>/run.sh` `runs/<time>/x` `.venv-vllm/bin/python` `ppo/gone.py` "
                   "`ppo/loss_value`\n\n"
                   "```\n[in code](docs/c.md) `benchmarks/also_gone.py`\n```\n")
    assert broken_links(doc, tmp_path) == ["docs/b.md: no such file in the repository",
                                           "docs/a.md#nope: a.md has no heading #nope"]
    # experiments/ does not exist in this tree: a placeholder does not excuse a missing folder before it
    assert missing_paths(doc, tmp_path) == ["benchmarks/gone.py", "experiments/<study>/run.sh", "ppo/gone.py"]
