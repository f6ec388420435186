"""torchtitan's Llama 3 state-dict adapter, told of no assets folder.

torchtitan builds the model spec's adapter with ``hf_assets_path`` and, when that folder has no
``model.safetensors.index.json``, warns on every run that it will save one safetensors file.
muloco's ``hf_assets_path`` holds a tokenizer, never weights: an initial Hugging Face load reads
its files from ``checkpoint.initial_load_path`` (``get_hf_storage_reader``), and the index only
serves HF-format saves, which muloco leaves to ``muloco.export``. So the adapter is built
without the folder: same mapping, no warning. Composed in by :func:`muloco.models.hf_adapter`.
"""

from __future__ import annotations

from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter


class Llama3Adapter(Llama3StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, None)
