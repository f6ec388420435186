"""``python -m muloco.generate``: kept for the command users type; the command is :mod:`muloco.tools.generate`."""

import sys

from muloco.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
