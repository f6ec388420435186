"""Files that ``muloco.export`` ships inside a Hugging Face folder (loaded there by transformers)."""

from pathlib import Path

FOLDER = Path(__file__).parent
"""Where they are, to copy from."""
