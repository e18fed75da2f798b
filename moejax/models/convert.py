"""Checkpoint conversion CLI::

    python -m moejax.convert hf-to-moejax SRC DST [--dtype float32|bfloat16|float16] [--expert-dtype int8] [--overwrite]
    python -m moejax.convert moejax-to-moejax SRC DST [--dtype ...] [--expert-dtype stored|int8] [--overwrite]
    python -m moejax.convert moejax-to-hf SRC DST [--dtype float32|bfloat16|float16] [--overwrite]

``hf-to-moejax`` reads a Hugging Face folder (config.json + single or sharded safetensors) and writes a
moejax checkpoint folder (safetensors shards under tree paths + moejax.json, tokenizer files copied);
``moejax-to-moejax`` rewrites a moejax folder (another dtype, or int8 experts); ``moejax-to-hf`` writes the
safetensors + config.json that ``transformers`` loads (int8 experts dequantised). ``--expert-dtype int8``
stores the routed experts as int8 with one float32 scale per output row (format version 3): the folder's
experts take half the bytes of bf16, load int8 as stored, and page half the bytes from storage when
offloaded; the rest of the model keeps ``--dtype``. All check every key and shape against the family's
key table, build the target under a temporary name and rename it at the end (an interrupted run leaves no
folder that loads), and refuse an existing target unless ``--overwrite``. ``--overwrite`` replaces only a
checkpoint folder (or an empty one), never the source or a folder containing it. SRC may be ``default``
(the embedded default model), as in every other command. Pickled ``.bin``/``.pt``
checkpoints are refused, never unpickled. The work is done by ``moejax.models.checkpoint``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from moejax.base import commands, errors, interrupts
from moejax.models import assets, checkpoint

DTYPES = ("float32", "bfloat16", "float16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("convert"), description=__doc__.split("\n\n")[0],
                                formatter_class=commands.HelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True, metavar="{" + ",".join(DIRECTIONS) + "}")
    for name, helptext in (("hf-to-moejax", "Hugging Face folder -> moejax checkpoint folder"),
                           ("moejax-to-moejax", "moejax checkpoint folder -> moejax checkpoint folder "
                                                "(another dtype, int8 experts)"),
                           ("moejax-to-hf", "moejax checkpoint folder -> Hugging Face folder")):
        s = sub.add_parser(name, help=helptext, description=helptext)
        s.add_argument("src", metavar="SRC", help="source folder")
        s.add_argument("dst", metavar="DST", help="target folder (must not exist unless --overwrite)")
        s.add_argument("--dtype", choices=DTYPES, default=None,
                       help="cast the parameters (default: keep the source dtype)")
        if name != "moejax-to-hf":
            s.add_argument("--expert-dtype", choices=checkpoint.EXPERT_DTYPES, default="stored",
                           help="int8: store the routed experts as int8 + one float32 scale per output row "
                                "(half the bytes; default: as the source stores them)")
        s.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return p


DIRECTIONS = ("hf-to-moejax", "moejax-to-moejax", "moejax-to-hf")


def convert(direction: str, src: str, dst: str, dtype: str | None = None, overwrite: bool = False,
            expert_dtype: str = "stored") -> str:
    """Run one conversion; raise ``CheckpointError`` / ``UnsupportedModelError`` / ``FileExistsError``."""

    src = os.path.abspath(os.path.expanduser(assets.resolve_model_path(src)))
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r} ({', '.join(DIRECTIONS)})")
    if direction == "hf-to-moejax":
        if os.path.isdir(src) and checkpoint.is_moejax_folder(src):
            raise checkpoint.CheckpointError(f"{src} is already a moejax checkpoint folder "
                                             "(use moejax-to-moejax to rewrite it, moejax-to-hf to export it)")
    elif os.path.isdir(src) and not checkpoint.is_moejax_folder(src):
        raise checkpoint.CheckpointError(f"{src} is not a moejax checkpoint folder (no "
                                         f"{checkpoint.FORMAT_FILE}); to import a Hugging Face folder use "
                                         "hf-to-moejax")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if expert_dtype not in checkpoint.EXPERT_DTYPES:
        raise ValueError(f"unsupported expert dtype {expert_dtype!r} (supported: {', '.join(checkpoint.EXPERT_DTYPES)})")
    if direction == "moejax-to-hf" and expert_dtype != "stored":
        raise ValueError("a Hugging Face folder stores experts in --dtype; --expert-dtype is for moejax folders")
    np_dtype = None
    if dtype is not None:
        import jax.numpy as jnp

        np_dtype = jnp.dtype(dtype)
    if direction == "moejax-to-hf":
        return checkpoint.convert_moejax_to_hf(src, dst, dtype=np_dtype, overwrite=overwrite)
    return checkpoint.convert_to_moejax(src, dst, dtype=np_dtype, overwrite=overwrite, expert_dtype=expert_dtype)


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    args = _parser().parse_args(argv)

    t0 = time.perf_counter()
    try:
        out = convert(args.direction, args.src, args.dst, args.dtype, args.overwrite,
                      getattr(args, "expert_dtype", "stored"))
    except errors.HANDLED as e:
        return errors.report(e)
    return errors.print_result(f"{args.direction}: wrote {out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
