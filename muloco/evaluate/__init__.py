"""Downstream evaluation of runs and Hugging Face folders with lm-evaluation-harness
(``python -m muloco.evaluate``; :mod:`muloco.evaluate.__main__`)."""
