"""``python -m moejax.evaluate``: the command lives in ``moejax.evaluation.evaluate`` (this module only starts it)."""

import sys

from moejax.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
