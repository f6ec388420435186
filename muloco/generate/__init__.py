"""Text sampled from a run: ``python -m muloco.generate`` (``__main__.py``)."""
