"""``python -m moejax.generate``: the command lives in ``moejax.runtime.generate`` (this module only starts it)."""

import sys

from moejax.runtime.generate import main

if __name__ == "__main__":
    sys.exit(main())
