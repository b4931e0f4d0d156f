"""``python -m tbe_like``: the ``tbe-like`` command (:mod:`tbe_like.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
