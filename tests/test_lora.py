"""LoRA adapters on muloco's model (:mod:`muloco.models.lora`) and their peft folders
(:mod:`muloco.hf.peft`): an adapter starts as the base model and only it trains, merging keeps
the logits, adapters applied on the meta device initialise with the model, an adapter saved from
muloco gives transformers + peft muloco's logits (Llama with grouped-query heads; Qwen2 with q/k/v
biases) and loads back bit for bit, and a folder peft saved gives muloco peft's logits.

Tolerance as in ``test_hf_families.py``: fp32 on both sides, ``max |Δlogit| <= 1e-5 · max |logit|``.
Weights and adapters are drawn with std 0.1, so the adapters move the logits by O(1) and a B of
q/k left in torchtitan's rotary row order would be off by far more than the tolerance.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tiny_model

from muloco import compat

compat.apply()

from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402
from muloco.evaluate.source import from_hf_folder  # noqa: E402
from muloco.hf.peft import TARGETS, adapter_settings, load_adapter, save_adapter  # noqa: E402
from muloco.models.lora import LoraConfig, apply_lora, lora_modules, lora_state, merge_lora, trainable_names  # noqa: E402

RELATIVE_TOLERANCE = 1e-5
IDS = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(1))
HF_IDS = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
SHAPES = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)
FAMILIES = {"llama": ("Llama", 10000.0), "qwen2": ("Qwen2", 1e6)}
"""Family → (transformers class prefix, RoPE base); Qwen2 has biases on q/k/v."""
LORA = LoraConfig(rank=8, alpha=16.0)


def relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 2) -> None:
    """Every adapter tensor drawn with std 0.1 (B is zero at init, which would hide a wrong B)."""
    torch.manual_seed(seed)
    for value in lora_state(model).values():
        value.normal_(0.0, 0.1)


def save_family(family: str, folder) -> torch.nn.Module:
    """A tiny transformers model with std-0.1 weights, saved in ``folder`` with the embedded tokenizer."""
    import transformers

    prefix, theta = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(
        **SHAPES, rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    shutil.copy(MulocoTokenizer().path, folder / "tokenizer.json")
    return model


def test_an_adapter_starts_as_the_base_model_and_only_the_adapters_train():
    model = tiny_model(causal=True)
    with torch.no_grad():
        base = model(IDS)
    wrapped = apply_lora(model, LORA)
    assert len(wrapped) == 2 * len(TARGETS)
    assert (
        set(trainable_names(model))
        == set(lora_state(model))
        == {f"{name}.lora_{which}.weight" for name in wrapped for which in "AB"}
    )
    assert all(isinstance(m, torch.nn.Linear) for m in lora_modules(model).values())
    model.verify_module_protocol()  # torchtitan's trainer checks it
    with torch.no_grad():
        assert torch.equal(model(IDS), base)
    model(IDS).square().mean().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(trainable_names(model))
    randomise(model)
    with torch.no_grad():
        assert relative_gap(model(IDS), base) > 1e-3


def test_adapters_applied_on_the_meta_device_initialise_with_the_model():
    """As torchtitan's trainer builds: on meta, then ``to_empty`` and ``init_weights``."""
    from muloco.models import ModelConfig, build_model_config

    with torch.device("meta"):
        model = build_model_config(ModelConfig(flavor="llama3-w64-d2-h2", vocab_multiple_of=1), 32).build()
    apply_lora(model, LORA)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    state = lora_state(model)
    assert all(not v.any() for k, v in state.items() if ".lora_B." in k)
    # A kaiming-uniform with a=sqrt(5), as peft draws it: U(±1/sqrt(fan_in))
    assert all(0 < v.abs().max() <= v.shape[1] ** -0.5 for k, v in state.items() if ".lora_A." in k)


def test_merging_folds_the_adapters_in_with_the_same_logits():
    model = tiny_model(causal=True)
    names = set(model.state_dict())
    apply_lora(model, LORA)
    randomise(model)
    with torch.no_grad():
        want = model(IDS)
        merge_lora(model)
        gap = relative_gap(model(IDS), want)
    print(f"merge: max |Δlogit| / max |logit| = {gap:.2e} (fp32)")
    assert gap <= RELATIVE_TOLERANCE
    assert set(model.state_dict()) == names and not lora_modules(model)
    assert type(model.layers["0"].attention.wo).__name__ == "Linear"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_adapter_gives_peft_the_logits_of_muloco_and_loads_back(tmp_path, family):
    peft = pytest.importorskip("peft")
    base, adapter = tmp_path / family, tmp_path / "adapter"
    theirs = save_family(family, base)
    source = from_hf_folder(base, torch.device("cpu"))
    model = source.model
    apply_lora(model, LORA)
    randomise(model)
    save_adapter(model, model.config, LORA, adapter, str(base))
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "muloco_base.json",
    ]
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == list(TARGETS)
    with torch.no_grad():
        plain = theirs(HF_IDS).logits
        theirs = peft.PeftModel.from_pretrained(theirs, str(adapter)).eval()
        want = theirs(HF_IDS).logits
        gap = relative_gap(model(HF_IDS), want)
    print(f"{family} peft {peft.__version__}: max |Δlogit| / max |logit| = {gap:.2e} (fp32)")
    assert gap <= RELATIVE_TOLERANCE
    assert relative_gap(plain, want) > 1e-3  # the adapters are there to be checked

    assert LoraConfig(**adapter_settings(adapter)) == LORA
    fresh = from_hf_folder(base, torch.device("cpu")).model
    apply_lora(fresh, LoraConfig(**adapter_settings(adapter)))
    load_adapter(fresh, adapter)
    ours, back = lora_state(model), lora_state(fresh)
    assert set(back) == set(ours) and all(torch.equal(back[k], v) for k, v in ours.items())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_adapter_peft_saved_loads_into_muloco_with_its_logits(tmp_path, family):
    """The other way: peft's own folder (its full config, its key order) read by muloco."""
    peft = pytest.importorskip("peft")
    base, adapter = tmp_path / family, tmp_path / "adapter"
    plain = save_family(family, base)
    with torch.no_grad():
        before = plain(HF_IDS).logits
    theirs = peft.get_peft_model(
        plain,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "down_proj"], task_type="CAUSAL_LM"),
    )
    randomise(theirs)
    theirs.save_pretrained(str(adapter))
    model = from_hf_folder(base, torch.device("cpu")).model
    assert apply_lora(model, LoraConfig(**adapter_settings(adapter)))
    load_adapter(model, adapter)
    with torch.no_grad():
        want = theirs.eval()(HF_IDS).logits
        gap = relative_gap(model(HF_IDS), want)
    print(f"{family} from peft: max |Δlogit| / max |logit| = {gap:.2e} (fp32)")
    assert gap <= RELATIVE_TOLERANCE
    assert relative_gap(before, want) > 1e-3


def test_targets_that_name_no_projection_are_refused_with_the_known_names():
    with pytest.raises(ValueError, match="gate_proj"):
        LoraConfig(rank=4, target_modules=["query"]).validate()
    with pytest.raises(ValueError, match="known targets.*q_proj"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(rank=4))


def test_an_adapter_of_another_rank_or_targets_does_not_load(tmp_path):
    model = tiny_model(causal=True)
    apply_lora(model, LORA)
    save_adapter(model, model.config, LORA, tmp_path / "a", "tiny")
    for other, what in (
        (LoraConfig(rank=4, alpha=16.0), "rank is 8"),
        (LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]), "target_modules"),
    ):
        fresh = tiny_model(causal=True)
        apply_lora(fresh, other)
        with pytest.raises(ValueError, match=what):
            load_adapter(fresh, tmp_path / "a")


def test_frozen_keys_are_the_state_dicts_under_activation_checkpointing():
    """A healing peer gets the state dict minus the frozen base: its keys must be the state
    dict's, which activation checkpointing's wrapper does not rename (named_parameters does)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from muloco.models import ModelConfig, init_model
    from muloco.models.lora import frozen_keys

    model = init_model(ModelConfig(flavor="llama3-w64-d2-h2", lora=LORA), 2048)
    plain = frozen_keys([model])
    for name, layer in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(layer))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    keys = set(model.state_dict())
    assert frozen_keys([model]) == plain and plain <= keys
    assert keys - plain == {k for k in keys if ".lora_" in k}
