"""``python -m muloco.report``: kept for the command users type; the command is :mod:`muloco.tools.report`."""

import sys

from muloco.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
