"""A run as a Hugging Face folder: the folder written (``folder.py``), uploaded to the Hub (``hub.py``);
``python -m muloco.export`` (``__main__.py``) is the command."""
