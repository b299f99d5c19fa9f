"""The repository is readable on its own: no file sends the reader to a document outside
it (the design note and engine notes the project grew from are not in the repository —
their content is, in docs/scoring.md and docs/design.md), and every relative link in a
Markdown file leads to a file that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Spelt in pieces so that this file does not name them itself.
OUTSIDE = ("DESIGN" + ".md", "../" + "shared", "REAL_ENGINES" + ".md")


def repo_files(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def test_no_file_refers_to_documents_outside_the_repository():
    found = []
    for path in repo_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binaries (.wasm, fixtures)
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {name}" for name in OUTSIDE if name in line]
    assert not found, "\n".join(found)


def test_every_relative_markdown_link_leads_to_a_file():
    broken = []
    for path in repo_files("*.md"):
        for m in re.finditer(r"\]\(([^)\s]+)\)", path.read_text()):
            target = m.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert not broken, "\n".join(broken)
