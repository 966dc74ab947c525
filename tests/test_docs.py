"""The docs stay true to the code: every relative link resolves, every quoted excerpt is still in its
script, and docs/make_figures.py still draws every figure the docs show (a short run of its own)."""

import os
import re
import subprocess
import sys

import pytest
from conftest import HF_ENV, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GUIDES = sorted((REPO / "docs").glob("[0-9]-*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_there_is_a_guide_per_script_in_the_reading_order():
    scripts = [re.search(r"`(\w+\.py)`", guide.read_text().splitlines()[0]).group(1) for guide in GUIDES]
    assert scripts == ["toy_linear.py", "train_unconditional.py", "train_dit.py", "train_text_to_image.py",
                       "train_lora.py"]


def test_the_readme_stays_short():
    """At most 330 lines of at most 100 columns: the rest belongs in the guides and the reference."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 330
    assert [n for n, line in enumerate(lines, 1) if len(line) > 100] == []


def test_the_reference_stays_within_440_lines():
    assert len((REPO / "docs" / "reference.md").read_text().splitlines()) <= 440


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_quoted_excerpts_are_still_in_the_script(guide):
    """Each ```python block of a guide is consecutive lines of its script (indentation aside)."""
    text = guide.read_text()
    script = re.search(r"`(\w+\.py)`", text.splitlines()[0]).group(1)
    lines = [line.strip() for line in (REPO / script).read_text().splitlines()]
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        quoted = [line.strip() for line in block.splitlines() if line.strip()]
        found = any(lines[i : i + len(quoted)] == quoted for i in range(len(lines)))
        assert found, f"{guide.name} quotes lines no longer in {script}:\n{block}"


def figures_shown():
    return {name for page in PAGES for name in re.findall(r"figures/([\w-]+\.png)", page.read_text())}


def test_every_figure_shown_is_committed_and_drawn_by_the_figure_script(tmp_path):
    shown = figures_shown()
    assert shown and all((REPO / "docs" / "figures" / name).exists() for name in shown)
    sys.path.insert(0, str(REPO / "docs"))
    import make_figures

    assert shown <= set(make_figures.FIGURES)
    subprocess.run([sys.executable, REPO / "docs" / "make_figures.py", "--short", "--out", tmp_path], check=True,
                   env={**os.environ, **HF_ENV}, timeout=900)
    assert shown <= {p.name for p in tmp_path.glob("*.png")}


# Written by data/make_tiny_sd.py and data/make_digit_pairs.py; not committed
BUILT_BY_A_COMMAND = {"data/tiny-sd", "data/digit-pairs", "data/digit-pairs/train"}


def test_every_repository_path_named_is_tracked_by_git():
    """A path the README, a guide or a script names under one of the repository's folders is in git: a
    .gitignore pattern once hid configs/dit-b-2, which the guides name, from every clone."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folders = sorted({path.split("/")[0] for path in tracked if "/" in path})
    named = re.compile(r"(?<![\w/.-])((?:%s)/[\w.*/-]*[\w*])" % "|".join(map(re.escape, folders)))
    missing = []
    for page in [*PAGES, *sorted(REPO.glob("*.py"))]:
        for path in set(named.findall(page.read_text())) - BUILT_BY_A_COMMAND:
            prefix = path.split("*")[0]
            if not any(t == path or t.startswith(prefix.rstrip("/") + "/") or (prefix != path and t.startswith(prefix))
                       for t in tracked):
                missing.append(f"{page.name}: {path}")
    assert not missing, missing
