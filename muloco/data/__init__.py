"""Data pipeline: tokenizers, the standard-library corpus and its train/validation split."""
