"""``python -m moejax.trace``: the command lives in ``moejax.experts.trace_command`` (this module only starts it)."""

import sys

from moejax.experts.trace_command import main

if __name__ == "__main__":
    sys.exit(main())
