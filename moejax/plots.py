"""``python -m moejax.plots``: the command lives in ``moejax.evaluation.plots`` (this module only starts it)."""

import sys

from moejax.evaluation.plots import main

if __name__ == "__main__":
    sys.exit(main())
