"""``python -m moejax.report``: the command lives in ``moejax.evaluation.report`` (this module only starts it)."""

import sys

from moejax.evaluation.report import main

if __name__ == "__main__":
    sys.exit(main())
