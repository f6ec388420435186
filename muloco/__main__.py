"""``python -m muloco COMMAND ...``: the same as the ``muloco`` console script (muloco.commands)."""

import sys

from muloco.commands import main

sys.exit(main())
