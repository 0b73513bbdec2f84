"""The README's "Use" snippet runs as printed: a user's first copy-paste must work, and quietly."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, run_script


def _use_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "no python block under '## Use'"
    return match.group(1)


@pytest.mark.timeout(120)
def test_use_snippet_runs_as_printed_without_warnings():
    proc = run_script(_use_snippet() + "\nprint('final loss', loss.item())\n")
    assert "stage 0: worker 'worker1'" in proc.stdout and "final loss" in proc.stdout
    noise = [line for line in proc.stderr.splitlines() if "Warning" in line]
    assert not noise, noise
