"""The ``moejax`` command: every command as ``moejax COMMAND`` and ``python -m moejax COMMAND``, running the same
``main`` as ``python -m moejax.COMMAND`` (which keeps working), with usage lines naming the form typed."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tomllib

import pytest
from support.commands import run_main

from moejax import cli
from moejax.base import commands, interrupts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_m(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_moejax_help_lists_every_command_and_python_m_moejax_is_the_same_command():
    ran = _python_m("moejax", "--help")
    assert ran.returncode == 0, ran.stderr
    listed = ran.stdout[ran.stdout.index("commands:"):]
    for name, (_, what) in commands.COMMANDS.items():
        assert f"  {name} " in listed and what in " ".join(listed.split())
    assert ran.stdout.startswith("usage: moejax ")


def test_each_command_is_a_module_main_and_the_old_module_form_still_runs_it():
    for name, (module, _) in commands.COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
    via_moejax = _python_m("moejax", "generate", "--help")
    via_module = _python_m("moejax.generate", "--help")
    assert via_moejax.returncode == via_module.returncode == 0
    assert via_moejax.stdout.startswith("usage: moejax generate ")
    assert via_module.stdout.startswith("usage: python -m moejax.generate ")
    options = lambda text: text[text.index("options:"):]  # noqa: E731 - the same options, only the name differs
    assert options(via_moejax.stdout) == options(via_module.stdout)


def test_a_missing_or_unknown_command_is_a_usage_error(capsys):
    ran = run_main(cli.main, capsys)
    assert ran.returncode == 2 and "required: COMMAND" in ran.stderr
    ran = run_main(cli.main, capsys, "sample")
    assert ran.returncode == 2 and "invalid choice: 'sample'" in ran.stderr and "generate" in ran.stderr


def test_a_command_run_by_moejax_names_itself_so_and_the_name_does_not_outlive_it(capsys):
    ran = run_main(cli.main, capsys, "train-prior", "--model", "default")  # --out missing: argparse refuses
    assert ran.returncode == 2 and "usage: moejax train-prior " in ran.stderr
    assert "moejax train-prior: error: the following arguments are required: --out" in ran.stderr
    assert commands.prog("train-prior") == "python -m moejax.train_prior"  # back to the module form
    assert commands.prog("generate") == "python -m moejax.generate"


def test_the_moejax_script_is_declared_and_known_as_a_command(monkeypatch):
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["moejax"] == "moejax.cli:main"
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/moejax", "generate"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "/usr/local/bin/moejax", "generate"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert interrupts.is_a_command()  # Ctrl-C handlers from the first import, as for python -m moejax.X


@pytest.mark.parametrize("name", sorted(commands.COMMANDS))
def test_every_command_answers_help_through_moejax(name, capsys):
    ran = run_main(cli.main, capsys, name, "--help")
    assert ran.returncode == 0 and ran.stdout.startswith(f"usage: moejax {name} "), ran.stderr


def test_every_option_with_a_default_shows_it_in_help(capsys):
    ran = run_main(cli.main, capsys, "generate", "--help")
    text = " ".join(ran.stdout.split())
    assert "--max-new-tokens MAX_NEW_TOKENS default: 64" in text  # no help text of its own: the default alone
    assert "--port PORT (default: 8000)" not in text  # generate's own options only
    assert "--prompt PROMPT prompt text (default: 'The history of the')" in text  # stated once, not twice
    assert text.count("(default:") >= 10
    ran = run_main(cli.main, capsys, "serve", "--help")
    assert "--port PORT default: 8000" in " ".join(ran.stdout.split())


def _parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a command's ``main`` builds (caught at its ``parse_args``; nothing else runs)."""
    caught = []

    def catch(self, *args, **kwargs):
        caught.append(self)
        raise SystemExit(0)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(SystemExit):
            importlib.import_module(module).main(["--help"])
    return caught[0]


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def test_every_option_says_what_happens_when_it_is_left_out(monkeypatch):
    """An option either is required, is a switch, has a default the help shows (the formatter adds it), or says
    in its own help what its absence means ("default: ...")."""
    silent = []
    for name, (module, _) in commands.COMMANDS.items():
        for action in _options(_parser_of(module, monkeypatch)):
            if action.required or action.help == argparse.SUPPRESS or action.nargs == 0:
                continue
            if action.default is None and "default" not in (action.help or "").lower():
                silent.append(f"{name} {action.option_strings[-1]}")
    assert silent == []
