"""The examples run as documented, and examples/README.md lists each of them."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"


@pytest.mark.timeout(240)
def test_checkpoint_resume_continues_as_an_uninterrupted_run():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "checkpoint_resume.py"), "--steps", "3", "--more", "3"],
                          capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, f"checkpoint_resume.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    match = re.search(r"largest weight difference, resumed vs uninterrupted: (\S+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) <= 1e-5, proc.stdout
    assert "resumed, trained 3 more" in proc.stdout


@pytest.mark.timeout(240)
def test_gpt_text_trains_the_captured_gpt_as_plain_pytorch_does(warm_python):
    """The example asserts the match itself (exit status 1 otherwise); a short run keeps the suite fast
    (forked from the warm interpreter)."""
    proc = warm_python.run([str(EXAMPLES / "gpt_text.py"), "--steps", "6", "--generate", "8"], timeout=220)
    assert proc.returncode == 0, f"gpt_text.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "6 steps' losses and parameters match plain PyTorch" in proc.stdout, proc.stdout
    stages = re.findall(r"^  stage \d: .*CapturedStage", proc.stdout, re.MULTILINE)
    assert len(stages) == 3, proc.stdout  # split at blocks.1 and blocks.3
    assert re.search(r"^pipe \(eval\): +\S", proc.stdout, re.MULTILINE), proc.stdout  # sampled in eval mode


def test_the_examples_readme_lists_every_example():
    listed = (EXAMPLES / "README.md").read_text()
    missing = [p.name for p in sorted(EXAMPLES.glob("*.py")) if f"`{p.name}`" not in listed]
    assert not missing, f"examples/README.md does not list {missing}"
