"""`--help` of every command and sub-command is readable in an 80-column terminal: every flag
name it advertises is printed whole (a table that cuts `--model-draft,--sp…` tells the user
nothing), and no line is wider than the terminal. The commands and their flags are found in
the click app itself, so a command or a flag added later is checked too."""

from __future__ import annotations

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from speculative.cli.main import app

try:  # typer >= 0.22 vendors click
    from typer._click.core import Context
except ImportError:  # pragma: no cover
    from click import Context

COLUMNS = 80


def commands(command=None, path: tuple[str, ...] = ()):
    """(path of sub-command names, click command) for the app and everything under it."""
    command = command or get_command(app)
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from commands(sub, (*path, name))


ALL = list(commands())


def flag_names(command) -> list[str]:
    """Every name of every visible option, the help option included."""
    params = command.get_params(Context(command))
    return [name for p in params if p.param_type_name == "option" and not p.hidden
            for name in (*p.opts, *p.secondary_opts)]


def help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(COLUMNS), "TERMINAL_WIDTH": None},
                                terminal_width=COLUMNS)
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_is_found():
    found = {" ".join(path) for path, _ in ALL}
    assert {"", "serve", "batch", "bench", "doctor", "rpc-server", "models", "models list"} <= found


@pytest.mark.parametrize("path,command", ALL, ids=[" ".join(p) or "speculate" for p, _ in ALL])
def test_help_prints_every_flag_name_whole_within_80_columns(path, command):
    text = help_text(path)
    words = set(text.replace(",", " ").replace("/", " ").split())
    cut = [name for name in flag_names(command) if name not in words]
    assert not cut, f"flag names not printed whole in `{' '.join(('speculate', *path))} --help`: {cut}\n{text}"
    wide = [line for line in text.splitlines() if len(line) > COLUMNS]
    assert not wide, f"lines wider than {COLUMNS} columns:\n" + "\n".join(wide)


def test_every_command_prints_its_help_with_the_app_renderer():
    """A command registered without cli.helpformat.App would fall back to typer's tables."""
    from speculative.cli.helpformat import HelpCommand, HelpGroup

    assert [" ".join(p) for p, c in ALL if not isinstance(c, (HelpCommand, HelpGroup))] == []
