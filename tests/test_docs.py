"""The documents hold: every link in README.md, BENCHMARKS.md and docs/ resolves (files, and headings by their
anchors), and every command they show exists — its script or make target is there, and `--help` answers and
lists each option the document gives it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
CLIS = {"minibatchd": "minibatch.daemon.cli", "minibatch-chat": "minibatch.tui.cli"}
CLIS["minibatch-serve"] = "minibatch.daemon.cluster.cli"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`([^`\n]+)`")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside one is an example, not a link)."""
    return FENCE.sub("", text)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links() -> list[tuple[str, str]]:
    return [
        (str(doc.relative_to(ROOT)), target)
        for doc in DOCS
        for target in LINK.findall(prose(doc.read_text()))
        if not target.startswith(("http://", "https://", "mailto:"))
    ]


@pytest.mark.parametrize("doc,target", links())
def test_every_link_resolves(doc, target):
    path, _, anchor = target.partition("#")
    where = (ROOT / doc).parent / path if path else ROOT / doc
    assert where.exists(), f"{doc}: {target}: no such file"
    if anchor:
        assert where.suffix == ".md", f"{doc}: {target}: an anchor into a file that is not Markdown"
        assert anchor in anchors(where), f"{doc}: {target}: no heading with that anchor in {path or doc}"


def shown_commands() -> dict[tuple[str, ...], set[str]]:
    """Each command the documents show (in code blocks and code spans), as (program, subcommand) or
    (script,) or ("make", target), with the options given to it."""
    shown: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        fenced = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
        spans = CODE.findall(prose(text))
        for line in fenced + spans:
            line = line.split(" #")[0].strip().rstrip("\\").strip()
            try:
                words = shlex.split(line)
            except ValueError:
                words = line.split()
            for i, word in enumerate(words):
                name = word.removeprefix(".venv/bin/")
                rest = words[i + 1 :]
                if name in CLIS:
                    sub = rest[0] if rest and re.fullmatch(r"[a-z]+", rest[0]) and name != "minibatch-chat" else ""
                    key = (name, sub) if sub else (name,)
                elif re.fullmatch(r"scripts/[a-z_]+\.(py|sh)", word) and (i > 0 or len(words) > 1):
                    key = (word,)
                elif word == "make" and rest and re.fullmatch(r"[a-z-]+", rest[0]):
                    key = ("make", rest[0])
                    rest = []
                else:
                    continue
                flags = {w.split("=")[0] for w in rest if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)}
                shown.setdefault(key, set()).update(flags)
                break
    return shown


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def help_text(key: tuple[str, ...]) -> str:
    if key[0] in CLIS:
        cmd = [sys.executable, "-m", CLIS[key[0]], *key[1:], "--help"]
    elif key[0].endswith(".sh"):
        return (ROOT / key[0]).read_text()  # a shell script's options are in its text
    else:
        cmd = [sys.executable, str(ROOT / key[0]), "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, f"{' '.join(key)} --help: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return proc.stdout


SHOWN = shown_commands()


def test_the_documents_show_the_commands_people_run_first():
    assert {("minibatchd", "start"), ("minibatch-chat",), ("make", "chat"), ("make", "test")} <= set(SHOWN)


@pytest.mark.parametrize("key", sorted(SHOWN), ids=" ".join)
def test_every_command_shown_exists_with_its_options(key):
    if key[0] == "make":
        assert key[1] in make_targets(), f"make {key[1]}: no such target in the Makefile"
        return
    if key[0].startswith("scripts/"):
        assert (ROOT / key[0]).is_file(), f"{key[0]}: no such script"
    text = help_text(key)
    missing = sorted(flag for flag in SHOWN[key] if not re.search(rf"{re.escape(flag)}\b", text))
    assert not missing, f"{' '.join(key)}: the documents give it {missing}, which its --help does not list"


def marked(path: Path, name: str) -> str:
    """The text between `<!-- NAME -->` and `<!-- /NAME -->` (found by marker, not by position)."""
    text = path.read_text()
    start, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
    assert start in text and end in text, (
        f"{path.name} lacks the markers {start.strip()} ... {end} that this test reads"
    )
    return text[text.index(start) + len(start) : text.index(end)]


def test_the_api_page_lists_every_endpoint_as_the_openapi_document_does():
    from minibatch.daemon.api.openapi import endpoint_table

    assert marked(ROOT / "docs" / "api.md", "endpoints") == endpoint_table(), (
        "docs/api.md's endpoint table is not the OpenAPI document's: "
        "print it with `.venv/bin/python -m minibatch.daemon.api.openapi --markdown`"
    )


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md: at most 250 lines; depth goes to docs/"
    assert "](docs/chat.svg)" in text and (ROOT / "docs" / "chat.svg").is_file()
    assert "make chat" in text and "make test" in text
