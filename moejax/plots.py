"""``python -m moejax.plots``: the command lives in ``moejax.evaluation.heatmap`` (this module only starts it)."""

import sys

from moejax.evaluation.heatmap import main

if __name__ == "__main__":
    sys.exit(main())
