"""``python -m moejax.convert``: the command lives in ``moejax.models.convert`` (this module only starts it)."""

import sys

from moejax.models.convert import main

if __name__ == "__main__":
    sys.exit(main())
