"""Every `a2` command written in a ```bash block of the README and the docs parses with today's command line: a
renamed option or subcommand fails here, not in a reader's terminal. Most of these blocks are not run
(tests/test_readme.py runs the README's and the tutorial's; the others need a cluster, a bucket or COCO files), so
without this a how-to page could name an option that no longer exists. Only parsing: nothing runs."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from launch.cli import parse

pytestmark = pytest.mark.outside_ray_group  # starts no Ray

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, words) of every `a2 ...` command in the ```bash blocks of `text`, read as the shell reads it:
    a line continued with a backslash joined to its next, split at `&&`, `||`, `;` and `|` outside quotes, and a
    quoted command run elsewhere (`ray exec CLUSTER 'cd ~/a2tune && a2 package ...'`) read as well. A command in
    usage notation (`[--port N]`) is no command to parse."""
    found, block, pending = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        if fence.startswith("```"):
            block, pending = fence == "```bash", ""
            continue
        if not block:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        found += [(number, words) for words in _commands(line)]
    return found


def _commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words = [], []
    for word in [*lexer, ";"]:
        if word in ("&&", "||", ";", "|", "&"):
            if words[:1] == ["a2"] and not any(w.startswith("[") for w in words):
                commands.append(words)
            words = []
            continue
        words.append(word)
        if " " in word and re.search(r"(^|[\s;&|])a2 ", word):  # a quoted command line
            commands += _commands(word)
    return commands


COMMANDS = [pytest.param(words, id=f"{page.relative_to(REPO)}:{number}")
            for page in PAGES for number, words in bash_commands(page.read_text(encoding="utf-8"))]


def test_the_docs_hold_the_commands_this_test_reads():
    """The walk finds the pages' commands (a change of fence or layout that hid them would pass every case)."""
    pages = {param.id.split(":")[0] for param in COMMANDS}
    assert len(COMMANDS) >= 60 and {"README.md", "docs/tutorial.md", "docs/how-to/package.md"} <= pages


def test_commands_are_read_as_the_shell_reads_them():
    text = ("```bash\na2 study run studies/smoke.yaml \\\n  train.xe_epochs=2  # two epochs\nls && a2 report x\n"
            "ray exec c.yaml 'cd ~/a2tune && a2 package p --upload s3://b/'\na2 mlflow serve [--port N]\n```\n"
            "a2 report outside\n")
    assert bash_commands(text) == [(3, ["a2", "study", "run", "studies/smoke.yaml", "train.xe_epochs=2"]),
                                   (4, ["a2", "report", "x"]), (5, ["a2", "package", "p", "--upload", "s3://b/"])]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_a2_command_of_the_docs_parses(command):
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parse(command[1:])
    except SystemExit as stop:
        assert not stop.code, f"{shlex.join(command)}: {said.getvalue().strip().splitlines()[-1:]}"
