"""What the script tests share: where the scripts are, how one is run, how its output is read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def run(env, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text[-3000:]}"
    return float(m.group(1))


def marked(path: Path, name: str) -> str:
    """The text between `<!-- NAME -->` and `<!-- /NAME -->` in a document (found by marker, not by position)."""
    text = path.read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    assert start in text and end in text, f"{path.name} lacks the markers {start} ... {end} that this test reads"
    return text[text.index(start) + len(start) : text.index(end)]
