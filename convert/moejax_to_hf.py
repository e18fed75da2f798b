#!/usr/bin/env python
"""Thin wrapper: `python convert/moejax_to_hf.py SRC DST [--dtype ...] [--overwrite]` ==
`python -m moejax.convert moejax-to-hf SRC DST ...` (see convert/README.md)."""

import sys

from moejax.models.convert import main

if __name__ == "__main__":
    sys.exit(main(["moejax-to-hf", *sys.argv[1:]]))
