"""``python -m moejax.train``: the command lives in ``moejax.training.train`` (this module only starts it)."""

import sys

from moejax.training.train import main

if __name__ == "__main__":
    sys.exit(main())
