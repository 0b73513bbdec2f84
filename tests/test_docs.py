"""Every user-guide page opens with code, and that code runs as printed.

A page's ```` ```python ```` blocks run in order as one script in a process of its own, from the repository
root; ```` ```py ```` blocks are shown, not run (fragments, or commands for several hosts). A page whose
code needs a launcher says so in an HTML comment before its first block, e.g.
``<!-- run: torchrun --standalone --nproc-per-node 3 -->``, and runs under it. The others run as
``python PAGE.py`` would, in a child forked from a warm interpreter that has imported torch and rrefpipe
(the ``warm_python`` fixture): ~4 CPU-seconds of imports less per page.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, WarmPython

GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_LAUNCHER = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")


def page_code(page: Path) -> tuple[str, list[str]]:
    """The page's runnable code and the command that runs a file of it."""
    text = page.read_text()
    code = "\n".join(block for block in _BLOCK.findall(text))
    launcher = _LAUNCHER.search(text)
    if launcher is None:
        return code, [sys.executable]
    words = launcher.group(1).split()
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return code, words


def test_the_guide_has_its_pages():
    names = {page.stem for page in GUIDE}
    assert {"concepts", "training", "porting", "skip-batchnorm-balance", "multihost", "timeline",
            "troubleshooting", "performance"} <= names


@pytest.mark.parametrize("page", GUIDE, ids=[page.stem for page in GUIDE])
def test_page_opens_with_code(page: Path):
    text = page.read_text()
    first_code = text.find("```python\n")
    assert first_code >= 0, f"{page.name} has no ```python block a test runs"
    first_section = text.find("\n## ")
    assert first_section < 0 or first_code < first_section, f"{page.name}: code should come before the first section"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", GUIDE, ids=[page.stem for page in GUIDE])
def test_page_code_runs(page: Path, tmp_path: Path, warm_python: WarmPython):
    code, command = page_code(page)
    script = tmp_path / f"{page.stem}.py"
    script.write_text(code)
    if command == [sys.executable]:
        proc = warm_python.run([str(script)], timeout=280)
    else:
        proc = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, f"{page.name}'s code failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
