"""The docs read as the product's, not as one machine's notebook: README.md and docs/*.md (and the study notes,
benchmarks/results/**/README.md) name no absolute path of one machine and no session; every relative link and
anchor they give resolves.

Plain text checks (re and pathlib only): no import of the package, no subprocess.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# An absolute path of one machine: /work/..., /root/..., /home/<name>/..., /tmp/<name>... . A placeholder after /tmp/
# (an upper-case NAME, $VAR, <what>, {...}) is a user's choice, not a machine's; ~/... (the user's own) never matches.
MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:/work/|/root/|/home/[\w.-]+/|/tmp/(?![A-Z][A-Z0-9_]*\b|\$|<|\{))")
# A word of the sessions the docs were written in: "session(s)", "this stop", "last stop".
SESSION_WORDS = re.compile(r"\bsessions?\b|\b(?:this|last) stop\b", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def study_notes() -> list[Path]:
    return sorted((REPO / "benchmarks" / "results").glob("**/README.md"))


def where(path: Path, text: str, start: int) -> str:
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    return f"{name}:{text.count(chr(10), 0, start) + 1}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def machine_paths(path: Path) -> list[str]:
    text = path.read_text()
    return [f"{where(path, text, m.start())}: {text[m.start():m.start() + 40].splitlines()[0]}"
            for m in MACHINE_PATH.finditer(text)]


def session_words(path: Path) -> list[str]:
    text = path.read_text()
    return [f"{where(path, text, m.start())}: {m.group(0)!r}" for m in SESSION_WORDS.finditer(text)]


def broken_links(path: Path) -> list[str]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # a link written inside inline code is an example, not a link
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto:, ...
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{where(path, text, m.start())}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where(path, text, m.start())}: {target} (no such heading in {dest.name})")
    return out


# --- the checks can fail -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sample", [
    "python -m slurmvla.table /work/croptab",
    "ran into /root/.cache/x",
    "see /home/alice/runs/a",
    "--out /tmp/table",
    "data.root=/tmp/mwdata/stick-push-v3",
])
def test_a_machine_path_is_flagged(sample):
    assert MACHINE_PATH.search(sample), sample


@pytest.mark.parametrize("sample", [
    "--out TABLE_DIR", "~/.cache/slurmvla/metaworld/$t", "/tmp/RUN_DIR", "/tmp/$RUN", "/tmp/<run>",
    "hydra.run.dir=outputs/demo", "benchmarks/results/rtc/README.md", "/data/droid_1.0.1", "/models/pi05_base",
])
def test_a_placeholder_or_relative_path_is_not(sample):
    assert not MACHINE_PATH.search(sample), sample


def test_session_words_are_flagged():
    for sample in ("ran this session", "Sessions made and dropped", "at the last stop", "This stop's runs"):
        assert SESSION_WORDS.search(sample), sample
    for sample in ("a connection's state", "obsession", "stop the run"):
        assert not SESSION_WORDS.search(sample), sample


def test_a_broken_link_or_anchor_is_flagged(tmp_path):
    (tmp_path / "other.md").write_text("# A page\n\n## Its section: one (of two)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#its-section-one-of-two) [gone](nosuch.md) [bad](other.md#nosuch) "
                    "[self](#a-heading) [web](https://example.com)\n\n# A heading\n\n```\n[in code](nosuch.md)\n```\n")
    found = broken_links(page)
    assert len(found) == 2 and "nosuch.md (no such file)" in found[0] and "#nosuch (no such heading" in found[1], found


def test_slugs_follow_github():
    assert slug("The hard mask: only the delay's actions guide") == "the-hard-mask-only-the-delays-actions-guide"
    assert slug("The first table: `keypoints_flow` at 2000 steps") == "the-first-table-keypoints_flow-at-2000-steps"
    assert slug("Training image augmentation (`data.augment`)") == "training-image-augmentation-dataaugment"


# --- the docs ----------------------------------------------------------------------------------------------------

def test_the_checks_find_the_docs():
    assert len(docs()) > 5 and (REPO / "docs" / "benchmarks.md") in docs()
    assert len(study_notes()) > 1


def test_no_machine_path():
    found = [hit for path in docs() + study_notes() for hit in machine_paths(path)]
    assert not found, "absolute paths of one machine (write a placeholder: RUN_DIR, DIR, ...):\n" + "\n".join(found)


def test_no_session_words():
    found = [hit for path in docs() + study_notes() for hit in session_words(path)]
    assert not found, "words of the sessions the docs were written in:\n" + "\n".join(found)


def test_every_relative_link_and_anchor_resolves():
    found = [hit for path in docs() + study_notes() for hit in broken_links(path)]
    assert not found, "links that do not resolve:\n" + "\n".join(found)


def test_benchmarks_md_is_the_results_as_they_stand():
    """The history of how a figure was reached lives beside its result files, not in the results page."""
    lines = (REPO / "docs" / "benchmarks.md").read_text().count("\n")
    # 379 lines held every table once with its command; the MT50 table (its protocol, commands and rows) added 45.
    assert lines <= 424, f"docs/benchmarks.md has {lines} lines: move the history to benchmarks/results/<study>/README.md"
