"""``python -m moejax.train_prior``: the command lives in ``moejax.training.train_prior`` (this module only starts it)."""

import sys

from moejax.training.train_prior import main

if __name__ == "__main__":
    sys.exit(main())
