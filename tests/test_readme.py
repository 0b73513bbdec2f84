"""The README's "Use" snippet runs as printed, quietly, and trains as the plain model does: a user's
first copy-paste must work."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, run_script

# Appended to the snippet: the same steps on the plain model in this process (the snippet leaves
# `model` as it was: the pipe trains copies on its workers). Its last loss is computed with the
# weights of the step before, so it checks every earlier step's gradients and update too.
_PLAIN = """
import copy
plain = copy.deepcopy(model)
sgd = torch.optim.SGD(plain.parameters(), lr=0.05)
for x, y in batches:
    sgd.zero_grad()
    plain_loss = F.cross_entropy(plain(x), y)
    plain_loss.backward()
    sgd.step()
torch.testing.assert_close(loss.detach(), plain_loss.detach(), rtol=1e-4, atol=1e-5)
print('final loss', loss.item(), 'plain', plain_loss.item())
"""


def _use_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "no python block under '## Use'"
    return match.group(1)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.timeout(120)
def test_use_snippet_runs_as_printed_without_warnings_and_matches_plain_training():
    proc = run_script(_use_snippet() + _PLAIN)
    assert "stage 0: worker 'worker1'" in proc.stdout and "final loss" in proc.stdout
    noise = [line for line in proc.stderr.splitlines() if "Warning" in line]
    assert not noise, noise


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
