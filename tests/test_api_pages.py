"""The API reference's pages document what the code has: every flag of the command-line parsers, and a
mkdocstrings directive for the modules of each page."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, help_text

API = ROOT / "docs" / "api"
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags(*command: str) -> set[str]:
    """The long options a parser's --help lists (argparse writes each of them there)."""
    return set(_FLAG.findall(help_text(*command))) - {"--help"}  # (at COLUMNS=100)


# Each command line and the API page that documents it: python -m workers on "Stage workers", python -m
# rrefpipe on "Command line".
_COMMANDS = [("workers.md", ("-m", "workers")), ("cli.md", ("-m", "rrefpipe", "timeline")),
             ("cli.md", ("-m", "rrefpipe", "demo")), ("cli.md", ("-m", "rrefpipe", "tutorial")),
             ("cli.md", ("-m", "rrefpipe", "schedule"))]


@pytest.mark.parametrize("name,command", _COMMANDS, ids=[" ".join(c[1:]) for _, c in _COMMANDS])
def test_the_api_pages_list_every_flag_of_the_command_lines(name: str, command: tuple[str, ...]):
    page = (API / name).read_text()
    flags = _flags(*command)
    assert flags, f"no flags found in {' '.join(command)} --help"
    missing = sorted(flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page))
    assert not missing, (f"docs/api/{name} lacks {missing} of `python {' '.join(command)}`: paste its "
                         "current --help (COLUMNS=100) into the page")


def test_the_command_line_page_lists_every_command_of_python_m_rrefpipe():
    usage = help_text("-m", "rrefpipe")
    commands = set(re.search(r"\{([a-z,]+)\}", usage).group(1).split(","))  # type: ignore[union-attr]
    page = (API / "cli.md").read_text()
    assert commands and all(f"  {c} " in page for c in commands), commands


@pytest.mark.parametrize("page", sorted(API.glob("*.md")), ids=lambda p: p.stem)
def test_each_api_page_renders_docstrings(page):
    assert re.search(r"^::: [\w.]+$", page.read_text(), re.MULTILINE), f"{page.name} has no ::: directive"
