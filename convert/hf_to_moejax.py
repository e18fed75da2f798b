#!/usr/bin/env python
"""Thin wrapper: `python convert/hf_to_moejax.py SRC DST [--dtype ...] [--overwrite]` ==
`python -m moejax.convert hf-to-moejax SRC DST ...` (see convert/README.md)."""

import sys

from moejax.models.convert import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-moejax", *sys.argv[1:]]))
