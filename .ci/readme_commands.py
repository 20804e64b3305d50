"""Print one of the README's set-up commands, exactly as the README shows it.

    python .ci/readme_commands.py main    # the block after "Run the main job"
    python .ci/readme_commands.py test    # the block after "Run the tests"
    python .ci/readme_commands.py docs    # the block after "Build the docs"

CI runs what this prints, verbatim in a fresh clone, so the README cannot drift from what CI
proves works.
"""
from __future__ import annotations

import sys
from pathlib import Path

LEADS = {"main": "Run the main job", "test": "Run the tests", "docs": "Build the docs"}


def command(readme: str, which: str) -> str:
    lines = readme.splitlines()
    lead = LEADS[which]
    starts = [i for i, line in enumerate(lines) if line.startswith(lead)]
    if len(starts) != 1:
        raise SystemExit(f"README.md: expected one line starting {lead!r}, found {len(starts)}")
    i = starts[0] + 1
    while i < len(lines) and not lines[i].startswith("```"):
        i += 1
    body = []
    for line in lines[i + 1:]:
        if line.startswith("```"):
            break
        body.append(line)
    else:
        raise SystemExit(f"README.md: no closed code block after {lead!r}")
    cmd = "\n".join(body).strip()
    if not cmd or "\n" in cmd:
        raise SystemExit(f"README.md: the block after {lead!r} must hold one command line, got {cmd!r}")
    return cmd


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in LEADS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(LEADS)}}}")
    print(command((Path(__file__).resolve().parent.parent / "README.md").read_text(), sys.argv[1]))
