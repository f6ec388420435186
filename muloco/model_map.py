"""``python -m muloco.model_map``: kept for the command users type; the CLI is ``muloco.sizing.cli``."""

import sys

from muloco.sizing.cli import main

if __name__ == "__main__":
    sys.exit(main())
