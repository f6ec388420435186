"""A tiktoken BPE file as a Hugging Face ``tokenizer.json``, for export.

transformers' ``TikTokenConverter`` builds the byte-level BPE (ranks → vocabulary and merges,
the pre-tokenization regex, special tokens after the ranks) that ``PreTrainedTokenizerFast``
loads. It reads the file with ``tiktoken.load.load_tiktoken_bpe``, which caches contents under
/tmp keyed by the path alone (a file edited in place would convert stale ranks): here it is
handed the ranks muloco's own reader parsed.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter


class _RanksConverter(TikTokenConverter):
    def __init__(self, ranks: dict[bytes, int], pattern: str, special_tokens: list[str]):
        super().__init__(vocab_file="(ranks given)", pattern=pattern, extra_special_tokens=special_tokens)
        self._ranks = ranks

    def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:  # the parsed ranks, not a file read
        return self._ranks


def tiktoken_to_hf(ranks: dict[bytes, int], pattern: str, special_tokens: list[str]) -> Tokenizer:
    """The tokenizer with these ranks and the special tokens at ids ``len(ranks) + i``."""
    tokenizer = _RanksConverter(ranks, pattern, special_tokens).converted()
    got = [tokenizer.token_to_id(t) for t in special_tokens[:3]]
    if got != [len(ranks) + i for i in range(3)]:  # the layout muloco trained with
        raise ValueError(f"converted tiktoken specials landed at {got}, not after the {len(ranks)} ranks")
    return tokenizer
