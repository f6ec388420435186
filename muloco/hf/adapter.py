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

import re

from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

from muloco.hf.config import read
from muloco.hf.llada import is_llada, to_llada_names, to_llama_names

QK_NORM = re.compile(r"layers\.(\d+)\.attention\.([qk])_norm\.weight")
HF_QK_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight")
POST_NORMS = {"post_attention_norm": "attn_output_norm", "post_ffn_norm": "mlp_output_norm"}
"""The sandwich block's output norms (``_pa``/``_pf``) → their names in the shipped
``modeling_muloco.py`` (transformers' ``post_attention_layernorm`` is the pre-FFN norm)."""
POST_NORM = re.compile(r"layers\.(\d+)\.(post_attention_norm|post_ffn_norm)\.weight")
HF_POST_NORM = re.compile(r"model\.layers\.(\d+)\.(attn_output_norm|mlp_output_norm)\.weight")
QKV_BIAS = re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.w([qkv])\.bias")
HF_QKV_BIAS = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias")


class Llama3Adapter(Llama3StateDictAdapter):
    """torchtitan's mapping, plus the per-head query/key norms of the ``_qk`` flavors as Qwen3
    names them (``self_attn.q_norm``/``k_norm``) and the sandwich block's output norms of the
    ``_pa``/``_pf`` flavors (:data:`POST_NORMS`): torchtitan's Llama 3 adapter has no entry for
    them and would drop them on export. A norm's weight scales one head's elements, so it takes the
    same reordering as the rows of one head of ``wq``/``wk`` (Hugging Face's half-split rotary
    layout against torchtitan's interleaved one). Qwen2's q/k/v biases likewise: a bias adds to
    its projection's rows, so those of q and k take the rows' reordering and v's none."""

    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, None)

    def _heads(self, which: str) -> int:
        """How many heads the rows of ``which`` (q or k) projection hold."""
        attention = self.model_config.layers[0].attention
        return attention.n_heads if which == "q" else attention.n_kv_heads or attention.n_heads

    def _bias_to_hf(self, which: str, bias):
        return bias if which == "v" else self._permute(bias[:, None], self._heads(which))[:, 0]

    def _bias_from_hf(self, which: str, bias):
        return bias if which == "v" else self._reverse_permute(bias[:, None], self._heads(which))[:, 0]

    def to_hf(self, state_dict):
        patterns = (QK_NORM, POST_NORM, QKV_BIAS)
        extra = {k: v for k, v in state_dict.items() if any(p.fullmatch(k) for p in patterns)}
        out = super().to_hf({k: v for k, v in state_dict.items() if k not in extra})
        for key, value in extra.items():
            if m := QK_NORM.fullmatch(key):
                out[f"model.layers.{m[1]}.self_attn.{m[2]}_norm.weight"] = self._permute(value[:, None], 1)[:, 0]
            elif m := POST_NORM.fullmatch(key):
                out[f"model.layers.{m[1]}.{POST_NORMS[m[2]]}.weight"] = value
            elif m := QKV_BIAS.fullmatch(key):
                out[f"model.layers.{m[1]}.self_attn.{m[2]}_proj.bias"] = self._bias_to_hf(m[2], value)
        return out

    def from_hf(self, hf_state_dict):
        patterns = (HF_QK_NORM, HF_POST_NORM, HF_QKV_BIAS)
        extra = {k: v for k, v in hf_state_dict.items() if any(p.fullmatch(k) for p in patterns)}
        out = super().from_hf({k: v for k, v in hf_state_dict.items() if k not in extra})
        ours = {v: k for k, v in POST_NORMS.items()}
        for key, value in extra.items():
            if m := HF_QK_NORM.fullmatch(key):
                out[f"layers.{m[1]}.attention.{m[2]}_norm.weight"] = self._reverse_permute(value[:, None], 1)[:, 0]
            elif m := HF_POST_NORM.fullmatch(key):
                out[f"layers.{m[1]}.{ours[m[2]]}.weight"] = value
            elif m := HF_QKV_BIAS.fullmatch(key):
                out[f"layers.{m[1]}.attention.qkv_linear.w{m[2]}.bias"] = self._bias_from_hf(m[2], value)
        return out


class LladaAdapter(Llama3Adapter):
    """The same mapping for a LLaDA folder: its keys renamed to Llama's on the way in and back
    on the way out (:mod:`muloco.hf.llada`), so DCP's Hugging Face reader finds them."""

    def to_hf(self, state_dict):

        return to_llada_names(super().to_hf(state_dict))

    def from_hf(self, hf_state_dict):

        return super().from_hf(to_llama_names(hf_state_dict))


def adapter_for(folder: str | None) -> type[Llama3Adapter]:
    """The adapter class for the weights of ``folder`` (an ``hf:DIR`` flavor's): LLaDA's names or
    Llama's (None: a model-map flavor, Llama's)."""
    if folder:
        if is_llada(read(folder)):
            return LladaAdapter
    return Llama3Adapter
