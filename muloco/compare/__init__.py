"""Comparison suites: the paper's runs on your data in one command (``python -m muloco.compare``)."""
