"""torchtitan's Llama 3 state-dict adapter, told of no assets folder.

torchtitan builds the model spec's adapter with ``hf_assets_path`` and, when that folder has no
``model.safetensors.index.json``, warns on every run that it will save one safetensors file.
muloco's ``hf_assets_path`` holds a tokenizer, never weights: an initial Hugging Face load reads
its files from ``checkpoint.initial_load_path`` (``get_hf_storage_reader``), and the index only
serves HF-format saves, which muloco leaves to ``muloco.export``. So the adapter is built
without the folder: same mapping, no warning. Composed in by :func:`muloco.models.hf_adapter`.
A LLaDA folder's weights go through the same mapping after a rename (:class:`LladaAdapter`).
"""

from __future__ import annotations

from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter


class Llama3Adapter(Llama3StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, None)


class LladaAdapter(Llama3Adapter):
    """The same mapping for a LLaDA folder: its keys renamed to Llama's on the way in and back
    on the way out (:mod:`muloco.compat.llada`), so DCP's Hugging Face reader finds them."""

    def to_hf(self, state_dict):
        from muloco.compat.llada import to_llada_names

        return to_llada_names(super().to_hf(state_dict))

    def from_hf(self, hf_state_dict):
        from muloco.compat.llada import to_llama_names

        return super().from_hf(to_llama_names(hf_state_dict))


def adapter_for(folder: str | None) -> type[Llama3Adapter]:
    """The adapter class for the weights of ``folder`` (an ``hf:DIR`` flavor's): LLaDA's names or
    Llama's (None: a model-map flavor, Llama's)."""
    if folder:
        from muloco.compat.llada import is_llada
        from muloco.hf_config import read

        if is_llada(read(folder)):
            return LladaAdapter
    return Llama3Adapter
