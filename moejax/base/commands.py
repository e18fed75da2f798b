"""The commands moejax has, and how a command names itself in its usage line: ``moejax NAME`` when the
``moejax`` command started it, else ``python -m moejax.NAME`` (both forms run the same ``main``)."""

from __future__ import annotations

import argparse
import contextlib
import copy

# name -> (module whose ``main(argv)`` runs it, one line on what it does); ``moejax --help`` lists them in this order
COMMANDS = {
    "generate": ("moejax.runtime.generate", "generate text from an MoE checkpoint, streaming it as it comes"),
    "serve": ("moejax.runtime.serve", "an OpenAI-compatible HTTP server sharing one live expert cache"),
    "evaluate": ("moejax.evaluation.evaluate", "perplexity (WikiText-2) and task accuracy (MMLU, GSM8K, "
                 "TruthfulQA, NQ-open); sweeps"),
    "studies": ("moejax.evaluation.studies", "the paper's studies on one model (fronts, lifetimes, cache sizes, "
                "eviction, tasks)"),
    "report": ("moejax.evaluation.report", "a markdown report (tables, comparisons, figures) from study results"),
    "plots": ("moejax.evaluation.heatmap", "the routing-trace heat map of one layer's tokens x experts"),
    "trace": ("moejax.experts.trace_command", "record routing traces and replay them through expert caches"),
    "convert": ("moejax.models.convert", "convert checkpoints between Hugging Face and moejax layouts, quantize"),
    "train": ("moejax.training.train", "train a small granular Qwen3-MoE on a WikiText-style corpus"),
    "train-prior": ("moejax.training.train_prior", "train the learned cache prior"),
    "random-checkpoint": ("moejax.testing.random_checkpoint", "write a random-weight checkpoint with a real "
                          "model's config (streaming, any size)"),
}
_MODULE_FORM = {"train-prior": "moejax.train_prior", "random-checkpoint": "moejax.testing.random_checkpoint"}
_started_by_moejax: list[bool] = []


@contextlib.contextmanager
def started_by_moejax():
    """While the ``moejax`` command runs a command, its usage lines say ``moejax NAME``."""
    _started_by_moejax.append(True)
    try:
        yield
    finally:
        _started_by_moejax.pop()


def prog(name: str) -> str:
    """The command's name in its usage line and errors."""
    return f"moejax {name}" if _started_by_moejax else f"python -m {_MODULE_FORM.get(name, 'moejax.' + name)}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as written (descriptions keep their layout), and every option that has a default and does not
    state it in its own help gets ``(default: X)``: a reader never has to guess what happens when it is left out."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._get_help_string(action):  # argparse prints no help line for help=None
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text
                or "%(default)" in text or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
