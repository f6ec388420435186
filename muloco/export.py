"""``python -m muloco.export``: kept for the command users type; the command is :mod:`muloco.tools.export`."""

import sys

from muloco.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
