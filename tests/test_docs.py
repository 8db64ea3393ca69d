"""The docs' examples run, and print what the docs say they print.

Every ```python block of a page under docs/ that is a whole program (it
ends in ``trio.run(...)``, or, when it needs no trio, in a line ``main()``)
is run as it is, in a process of its own, from the repository root; one that says it uses a name defined ``as above``
(``# PreferZone as above``) runs after the earlier snippet that defines it.
When the page shows its output in the plain ``` block right after it, the
program's output must match it line for line, where a run of digits stands
for any number (ports, timings and counts differ from
run to run; words, statuses' positions and the order of lines do not).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def _examples() -> list[tuple[str, str, str | None]]:
    """``(id, program, expected output or None)`` for every whole program in the docs."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        blocks = list(FENCE.finditer(text))
        snippets: list[str] = []
        for i, block in enumerate(blocks):
            language, code = block.group(1), block.group(2)
            if language != "python":
                continue
            if not re.search(r"^(trio\.run\(|main\(\)$)", code, re.MULTILINE):
                snippets.append(code)
                continue
            for name in re.findall(r"^# (\w+) as above$", code, re.MULTILINE):
                defining = [s for s in snippets if re.search(rf"^(class|def|async def) {name}\b", s, re.MULTILINE)]
                assert defining, f"{page.name}: no snippet above defines {name}"
                code = "\n\n".join([*defining, code])
            expected = None
            if i + 1 < len(blocks):
                following = blocks[i + 1]
                between = text[block.end() : following.start()]
                if following.group(1) == "" and not between.strip():
                    expected = following.group(2)
            line = text.count("\n", 0, block.start()) + 1
            found.append((f"{page.name}:{line}", code, expected))
    return found


EXAMPLES = _examples()


def _pattern(line: str) -> re.Pattern[str]:
    parts = re.split(r"(\d+(?:\.\d+)?)", line.rstrip())
    return re.compile("".join(r"\d+(?:\.\d+)?" if i % 2 else re.escape(part) for i, part in enumerate(parts)))


def test_the_docs_have_whole_examples() -> None:
    assert len(EXAMPLES) >= 10, [name for name, _, _ in EXAMPLES]


@pytest.mark.parametrize(("code", "expected"), [(c, e) for _, c, e in EXAMPLES], ids=[n for n, _, _ in EXAMPLES])
def test_a_docs_example_runs_and_prints_what_the_page_shows(code: str, expected: str | None) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if expected is None:
        return
    got = [line for line in result.stdout.splitlines() if line.strip()]
    want = [line for line in expected.splitlines() if line.strip()]
    assert len(got) == len(want), f"printed:\n{result.stdout}\nthe page shows:\n{expected}"
    for printed, shown in zip(got, want, strict=True):
        assert _pattern(shown).fullmatch(printed.rstrip()), f"printed {printed!r}, the page shows {shown!r}"
