"""``python -m moejax COMMAND [options]``: the ``moejax`` command (``moejax.cli``)."""

import sys

from moejax.cli import main

if __name__ == "__main__":
    sys.exit(main())
