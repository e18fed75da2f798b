"""``moejax COMMAND [options]`` (and ``python -m moejax``): one entry point for every command. Each command
is the ``main`` of its module, imported when chosen (so ``moejax --help`` and a command start without
loading the others); ``python -m moejax.COMMAND`` runs the same ``main``."""

from __future__ import annotations

import argparse
import importlib
import sys

from moejax import __version__
from moejax.base import commands


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, commands.COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in commands.COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="moejax", usage="moejax [-h] [--version] COMMAND [options]",
        formatter_class=commands.HelpFormatter,
        description="Mixture-of-Experts inference in JAX with cache-aware routing and expert offloading.",
        epilog=f"commands:\n{listing}\n\n'moejax COMMAND --help' shows a command's options; "
               "'python -m moejax.COMMAND' (train-prior: moejax.train_prior) runs the same command.")
    p.add_argument("command", metavar="COMMAND", choices=list(commands.COMMANDS), help="one of the commands below")
    p.add_argument("--version", action="version", version=f"moejax {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module, _ = commands.COMMANDS[args.command]
    with commands.started_by_moejax():
        return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
