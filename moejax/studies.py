"""``python -m moejax.studies``: the command lives in ``moejax.evaluation.studies`` (this module only starts it)."""

import sys

from moejax.evaluation.studies import main

if __name__ == "__main__":
    sys.exit(main())
