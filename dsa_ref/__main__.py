"""``python -m dsa_ref verify``: the same as the ``dsa-ref`` console script (see `dsa_ref.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
