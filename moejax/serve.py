"""``python -m moejax.serve``: the command lives in ``moejax.runtime.serve`` (this module only starts it)."""

import sys

from moejax.runtime.serve import main

if __name__ == "__main__":
    sys.exit(main())
