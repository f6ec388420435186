"""``python -m muloco.export``: a tiny next-token run becomes a Hugging Face folder that
transformers loads, with muloco's logits and tokens; what it cannot express yet is one clear
error and writes nothing; a corrupt checkpoint is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_train

from muloco import compat

compat.apply()

from muloco.config.cli import parse_args  # noqa: E402
from muloco.export import _unsupported, main  # noqa: E402
from muloco.generate import load_config, load_model  # noqa: E402
from muloco.models import init_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TEXT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    proc = run_train(["--config", "ddp/adamw", *TINY, "--training.steps", "4", "--checkpoint.interval", "4",
                      "--validator.freq", "4", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_ar_run_loads_in_transformers_with_muloco_logits_and_tokens(ar_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    config = load_config(ar_run)
    model, tokenizer, _, step, is_global = load_model(ar_run, config, None, torch.device("cpu"))
    assert step == 4 and not is_global
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tokenizer.encode(TEXT, add_bos=True)
    assert AutoTokenizer.from_pretrained(str(out))(TEXT)["input_ids"] == ids  # BOS first, as muloco trains
    with torch.no_grad():
        ours = model(torch.tensor([ids]))
        theirs = hf(torch.tensor([ids])).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit difference| muloco vs transformers: {diff:.3g}")
    assert diff <= 1e-4
    card = (out / "README.md").read_text()
    summary = json.loads((ar_run / "summary.json").read_text())
    assert "config module: `ddp/adamw`" in card and str(summary["tokens_seen"]) in card
    assert str(ar_run) not in card  # no path of this machine


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory) -> Path:
    """K=2 MuLoCo through the local launcher (its lighthouse), checkpoint at the last step."""
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("export-diloco") / "run"
    proc = subprocess.run([sys.executable, "-m", "muloco.launch.local", "--config", "diloco/muloco", "--replicas", "2",
                           "--", *TINY, "--training.steps", "10", "--outer.sync_every", "5",
                           "--checkpoint.interval", "10", "--validator.freq", "10", "--dump_folder", str(run)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_a_diloco_run_exports_theta_g_with_the_fingerprint_the_run_recorded(diloco_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from muloco.export import global_fingerprint

    out = tmp_path / "hf"
    assert main([str(diloco_run), "--out", str(out), "--replica", "1"]) == 0, capsys.readouterr().err
    recorded = json.loads((diloco_run / "replica_1" / "summary.json").read_text())["diloco"]["final_global_sha256"]
    assert f"θ_g sha256: `{recorded}`" in (out / "README.md").read_text()
    assert "K=2 replica groups, H=5" in (out / "README.md").read_text()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    config = load_config(diloco_run / "replica_0")
    model, _, _, _, is_global = load_model(diloco_run / "replica_0", config, None, torch.device("cpu"))
    assert is_global and global_fingerprint(model) == recorded  # both replicas hold one θ_g
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def mdlm_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export-mdlm") / "run"
    proc = run_train(["--config", "ddp/adamw", "--objective", "mdlm", *TINY, "--training.steps", "4",
                      "--checkpoint.interval", "4", "--validator.freq", "4", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_mdlm_run_loads_as_a_bidirectional_model_with_muloco_logits_and_its_card_samples(mdlm_run, tmp_path,
                                                                                             capsys):
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "hf"
    assert main([str(mdlm_run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "trust_remote_code=True" in capsys.readouterr().out
    config = load_config(mdlm_run)
    model, tokenizer, _, _, _ = load_model(mdlm_run, config, None, torch.device("cpu"))
    hf = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert hf.config.mask_token_id == tokenizer.mask_id
    ids = tokenizer.encode(TEXT, add_bos=True)
    ids[3] = ids[6] = tokenizer.mask_id
    x = torch.tensor([ids])
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
        earlier = (hf(changed).logits[0, 0] - hf(x).logits[0, 0]).abs().max().item()
    print(f"max |logit difference| muloco vs transformers (mdlm): {diff:.3g}")
    assert diff <= 1e-4 and earlier > 0  # the first position sees the last: bidirectional
    card = (out / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0].replace("DIR", repr(str(out)))
    exec(compile(snippet, "README.md", "exec"), {})  # the card's sampling loop runs as written
    assert "Once upon a time" in capsys.readouterr().out


def test_a_non_empty_out_and_a_corrupt_checkpoint_are_refused_and_nothing_is_written(ar_run, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main([str(ar_run), "--out", str(busy)]) == 2
    assert "is not empty" in capsys.readouterr().err and [p.name for p in busy.iterdir()] == ["keep.txt"]
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(ar_run, broken)
    data = next((broken / "checkpoint" / "step-4").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-16] + b"\0" * 16)
    assert main([str(broken), "--out", str(tmp_path / "out")]) == 2
    assert "muloco.export: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("flavor, objective, feature", [
    ("llama3-w64-d2-h2_qk_torch-rmsnorm", "ar", "QK norm"),
    ("llama3-w64-d2-h2_pa_pf", "ar", "post-attention/post-FFN norms"),
])
def test_what_transformers_cannot_express_yet_is_named(flavor, objective, feature):
    _, c = parse_args(["--config", "ddp/adamw", "--model.flavor", flavor, "--objective", objective])
    tokenizer = c.tokenizer.build(tokenizer_path=c.hf_assets_path)
    model = init_model(c.model, tokenizer.get_vocab_size(), objective == "ar", torch.device("cpu"))
    why = _unsupported(model.config, objective, tokenizer)
    assert why is not None and why.startswith(feature), why
