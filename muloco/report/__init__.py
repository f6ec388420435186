"""The report: run folders and sweeps read back (``runs.py``), their table (``tables.py``) and plots
(``plots.py``); ``python -m muloco.report`` (``__main__.py``) is the command."""
