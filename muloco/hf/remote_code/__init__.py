"""Files that ``muloco.export`` ships inside a Hugging Face folder (loaded there by transformers)."""
