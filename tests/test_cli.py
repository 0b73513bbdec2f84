"""``python -m rrefpipe``: every flag explained in --help; the timeline command writes both files."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from argparse import SUPPRESS
from types import ModuleType

import pytest
from PIL import Image

from rrefpipe.__main__ import CHECKPOINT_HELP, main, parser
from tests.conftest import ROOT, help_text, warm
from workers.__main__ import parser as workers_parser


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m rrefpipe ARGS``, forked from the warm interpreter."""
    proc = warm().run(["-m", "rrefpipe", *args], timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"python -m rrefpipe {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def options_without_help(text: str) -> list[str]:
    """Option lines of an argparse --help with no explanation beside or below them."""
    lines = text.splitlines()
    options = lines[next(i for i, line in enumerate(lines) if line.startswith("options:")) + 1:]
    bare = []
    for k, line in enumerate(options):
        m = re.match(r"^  (-[-\w]+(?: [A-Z_{},\w]+)?(?:, -[-\w]+(?: [A-Z_]+)?)?)(\s{2,}\S.*)?$", line)
        if m and not m.group(2):
            below = options[k + 1] if k + 1 < len(options) else ""
            if not below.startswith(" " * 8) or below.strip().startswith("-"):
                bare.append(m.group(1))
    return bare


@pytest.mark.parametrize("command", [[], ["demo"], ["tutorial"], ["timeline"]])
def test_help_explains_every_flag(command):
    text = help_text("-m", "rrefpipe", *command)
    assert "usage:" in text
    assert options_without_help(text) == []
    if not command:
        for name in ("demo", "tutorial", "timeline"):
            assert name in text


def test_help_lists_each_command_once():
    text = help_text("-m", "rrefpipe")
    for name in ("demo", "tutorial", "timeline"):
        entries = [line for line in text.splitlines() if re.match(rf"^\s+{name}\s{{2,}}\S", line)]
        assert len(entries) == 1, text


@pytest.mark.parametrize("name", ["demo", "tutorial"])
def test_example_help_names_the_command_that_ran_it(name):
    assert help_text("-m", "rrefpipe", name).startswith(f"usage: python -m rrefpipe {name} [-h]")
    assert help_text(f"examples/{name}.py").startswith(f"usage: {name}.py [-h]")


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_cli_test_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _parsers() -> dict[str, argparse.ArgumentParser]:
    timeline = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["timeline"]
    return {"timeline": timeline, "demo": _example("demo").parser(), "tutorial": _example("tutorial").parser(),
            "workers": workers_parser()}


@pytest.mark.parametrize("name", ["timeline", "demo", "tutorial", "workers"])
def test_option_help_shows_the_default(name):
    actions = [a for a in _parsers()[name]._actions if a.option_strings and a.default not in (None, False, SUPPRESS)]
    assert actions
    assert [a.option_strings[0] for a in actions if "default" not in (a.help or "").lower()] == []


@pytest.mark.parametrize("name", ["timeline", "demo", "tutorial"])
def test_checkpoint_help_says_where_stages_recompute(name):
    """As Pipe's docstring and rrefpipe.stage_side.stage have it: CPU stages before the last recompute ahead of
    backward."""
    (action,) = [a for a in _parsers()[name]._actions if "--checkpoint" in a.option_strings]
    assert action.help == CHECKPOINT_HELP
    assert "CPU stages before the last recompute while they wait for the gradient" in CHECKPOINT_HELP
    assert "the last stage and GPU stages recompute in backward" in CHECKPOINT_HELP


def test_unknown_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["timeline", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_timeline_command_writes_json_and_png_and_redraws(tmp_path):
    prefix = tmp_path / "tl"
    out = cli("timeline", "--out", str(prefix), "--stages", "2", "--chunks", "3", "--steps", "2", "--width", "64",
              "--batch-size", "48").stdout
    assert "tl.json" in out and "tl.png" in out
    spans = [e for e in json.loads((tmp_path / "tl.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in spans}) == [0, 1]
    assert sum(e["cat"] == "forward" for e in spans) == 2 * 3  # the last step only
    assert Image.open(tmp_path / "tl.png").size == (1200, round((1.2 + 0.55 * 2) * 100))
    cli("timeline", "--from-json", str(tmp_path / "tl.json"), "--out", str(tmp_path / "again"))
    assert Image.open(tmp_path / "again.png").size == (1200, 230)
    # without matplotlib: one line saying what to install, no traceback
    blocked = "import sys; sys.modules['matplotlib'] = None; from rrefpipe.__main__ import main; main()"
    proc = subprocess.run([sys.executable, "-c", blocked, "timeline", "--from-json", str(tmp_path / "tl.json"),
                           "--out", str(tmp_path / "none")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("python -m rrefpipe timeline: drawing the timeline needs matplotlib")


@pytest.mark.timeout(120)
def test_demo_trains_in_float16_with_loss_scaling_like_plain_pytorch():
    out = cli("demo", "--amp", "float16", "--stages", "2", "--steps", "20").stdout
    assert "loss scale at the end: " in out
    final = {m["who"]: float(m["loss"])
             for m in re.finditer(r"(?P<who>pipeline|plain PyTorch).*?final loss (?P<loss>[\d.]+)", out)}
    assert set(final) == {"pipeline", "plain PyTorch"}, out
    assert final["pipeline"] == pytest.approx(final["plain PyTorch"], abs=1e-3), out
