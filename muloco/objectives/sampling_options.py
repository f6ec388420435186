"""The diffusion sampler's named options, without torch: ``generate --help`` lists them before
anything heavy loads (``sampling.py`` checks a run's choice against the same tuples)."""

ORDERS = ("confidence", "margin", "entropy", "random")
"""Which masked positions a step fills first: the predicted token's probability, the gap between
the two most likely tokens, the negative entropy, or a random order."""
CACHES = ("none", "prefix", "dual")
"""``prefix``: Fast-dLLM's block-wise prefix cache; ``dual``: its dual cache (prefix and suffix)."""
