"""``python -m muloco.export``: a tiny next-token run becomes a Hugging Face folder that
transformers loads, with muloco's logits and tokens; what it cannot express yet is one clear
error and writes nothing; a corrupt checkpoint is refused."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_train, run_watched

from muloco import compat

compat.apply()

from test_import import _hf_load  # noqa: E402

from muloco.config.cli import parse_args  # noqa: E402
from muloco.export.__main__ import main  # noqa: E402
from muloco.export.folder import _unsupported  # noqa: E402
from muloco.models import init_model  # noqa: E402
from muloco.trained_model import load_config, load_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # hang timeouts: several trainings on 2 cores

TEXT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--training.steps",
            "4",
            "--checkpoint.interval",
            "4",
            "--validator.freq",
            "4",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_ar_run_loads_in_transformers_with_muloco_logits_and_tokens(ar_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    old = os.umask(0o027)  # a group-readable umask: the export is readable as it says, folder and files
    try:
        assert main([str(ar_run), "--out", str(out)]) == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= {p.name for p in out.iterdir()}
    assert out.stat().st_mode & 0o777 == 0o750
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {p.name: "0o640" for p in out.iterdir()}
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
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation\n")  # the Hub's header
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == config.training.seq_len
    summary = json.loads((ar_run / "summary.json").read_text())
    assert "config module: `ddp/adamw`" in card and str(summary["tokens_seen"]) in card
    assert str(ar_run) not in card  # no path of this machine


@pytest.fixture(scope="module")
def mdlm_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export-mdlm") / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            "--objective",
            "mdlm",
            *TINY,
            "--training.steps",
            "4",
            "--checkpoint.interval",
            "4",
            "--validator.freq",
            "4",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_mdlm_run_loads_as_a_bidirectional_model_with_muloco_logits_and_its_card_samples(mdlm_run, tmp_path, capsys):
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "hf"
    assert main([str(mdlm_run), "--out", str(out), "--license", "apache-2.0"]) == 0, capsys.readouterr().err
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert (out / "README.md").read_text().startswith("---\nlicense: apache-2.0\nlibrary_name: transformers\n")
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
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, says in (
        (a_file, "is a file"),
        (a_file / "below", "is under"),
        ("/proc/muloco-export", "cannot be created"),
    ):
        assert main([str(ar_run), "--out", str(out)]) == 2  # before the checkpoint is converted
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and err.count("error:") == 1, err
    assert main([str(ar_run), "--out", str(tmp_path / "out"), "--license", "Apache 2.0"]) == 2
    assert "--license 'Apache 2.0' is not a license id" in capsys.readouterr().err
    # a checkpoint that cannot be loaded: exit 3, as train, generate and evaluate end on one
    assert main([str(ar_run), "--step", "999", "--out", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err  # export's own flag, not the trainer's
    assert "checkpoint step 999 does not exist" in err and "Pick one with --step N" in err and "load_step" not in err
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(ar_run, broken)
    data = next((broken / "checkpoint" / "step-4").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-16] + b"\0" * 16)
    assert main([str(broken), "--out", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err  # export's (and generate's) own way out, not the trainer's
    assert "muloco export: error:" in err and "is corrupt" in err and "only complete checkpoint" in err, err
    assert "load_step" not in err and "Delete that step folder" not in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_tiktoken_run_exports_a_tokenizer_json_that_encodes_as_muloco_does(tmp_path, capsys):
    """A tiktoken BPE file (Llama 3's format: base64 token, rank) is converted with its special
    tokens after the ranks; the folder's tokenizer gives muloco's ids, BOS first."""
    import base64

    from transformers import AutoModelForCausalLM, AutoTokenizer

    merges = [b"th", b"he", b"the", b"  ", b"in", b"re", b"return", b"de", b"def", b" t", b" the"]
    tokens = [bytes([b]) for b in range(256)] + merges
    tiktoken_file = tmp_path / "tokenizer.model"
    tiktoken_file.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    run = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--tokenizer.path",
            str(tiktoken_file),
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "2",
            "--validator.no-enable",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    model, tokenizer, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    theirs = AutoTokenizer.from_pretrained(str(out))
    for text in (TEXT, "def the_return(x):\n    return x  # é ☃ 123456", "   spaces\t\ttabs\n\n"):
        assert theirs(text)["input_ids"] == tokenizer.encode(text, add_bos=True), text
    assert theirs.decode(tokenizer.encode(TEXT)) == TEXT
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(TEXT, add_bos=True)])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_what_this_export_cannot_write_yet_is_named():
    _, c = parse_args(["--config", "ddp/adamw", *TINY])
    tokenizer = c.tokenizer.build(tokenizer_path=c.hf_assets_path)
    model = init_model(c.model, tokenizer.get_vocab_size(), True, torch.device("cpu"))
    from muloco.objectives import Autoregressive, MaskedDiffusion

    assert _unsupported(model.config, Autoregressive, tokenizer) is None
    assert _unsupported(model.config, MaskedDiffusion, tokenizer) is None  # the embedded tokenizer has a mask token
    no_mask = types.SimpleNamespace(mask_id=None)
    assert _unsupported(model.config, MaskedDiffusion, no_mask) == (
        "a masked diffusion run whose tokenizer has no mask token"
    )


@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_the_sandwich_flavor_exports_with_its_shipped_class_and_muloco_logits(objective, tmp_path, capsys):
    """The GPU presets' block (QK norms, post-attention and post-FFN norms): the folder ships
    modeling_muloco.py; transformers loads it (trust_remote_code) with muloco's logits, and it
    reads back bit for bit."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from muloco.evaluate.source import from_hf_folder

    run = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--objective",
            objective,
            "--model.flavor",
            "llama3-w64-d2-h2_qk_torch-rmsnorm_pa_pf",
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "2",
            "--validator.no-enable",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "trust_remote_code=True" in capsys.readouterr().out and (out / "modeling_muloco.py").is_file()
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["bidirectional"]) == ("muloco", objective == "mdlm")
    model, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    auto = AutoModelForMaskedLM if objective == "mdlm" else AutoModelForCausalLM
    hf = auto.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"max |logit difference| muloco vs transformers, {objective} _qk_pa_pf: {diff:.3g}")
    assert diff <= 1e-4
    back = from_hf_folder(out, torch.device("cpu")).model.state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_export_then_import_gives_the_parameters_bit_for_bit_and_a_run_started_from_it_trains_alike(
    ar_run, tmp_path, capsys
):
    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0, capsys.readouterr().err
    config = load_config(ar_run)
    model, tokenizer, _, _, _ = load_model(ar_run, config, None, torch.device("cpu"))
    loaded = _hf_load(out, "llama3-w64-d2-h2", tokenizer.get_vocab_size())
    source = model.state_dict()
    assert loaded.keys() == source.keys()
    assert all(torch.equal(loaded[k], source[k]) for k in source), "the round trip changed a parameter"

    def losses(initial: list[str], name: str) -> dict[int, float]:
        run = tmp_path / name
        proc = run_train(
            [
                "--config",
                "ddp/adamw",
                *TINY,
                "--training.steps",
                "3",
                "--metrics.log_freq",
                "1",
                "--validator.no-enable",
                "--checkpoint.interval",
                "1000",
                "--checkpoint.initial_load_model_only",
                *initial,
                "--dump_folder",
                str(run),
            ]
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    from_hf = losses(["--checkpoint.initial_load_path", str(out), "--checkpoint.initial_load_in_hf"], "from-hf")
    from_muloco = losses(["--checkpoint.initial_load_path", str(ar_run / "checkpoint" / "step-4")], "from-dcp")
    assert from_hf == from_muloco and len(from_hf) == 3, (from_hf, from_muloco)


def test_a_hugging_face_folder_of_another_shape_is_one_error_naming_the_difference(ar_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--model.flavor",
            "llama3-w128-d4-h2",
            "--checkpoint.initial_load_path",
            str(out),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(tmp_path / "run"),
        ]
    )
    assert proc.returncode != 0 and "hidden_size is 64 there and 128 here" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_push_to_hub_uploads_the_folder_in_one_commit_with_the_token_from_the_environment(
    ar_run, tmp_path, capsys, monkeypatch
):
    """The Hub is a local stand-in at its HTTP boundary (tests/hub_stub.py); the token reaches it and
    nothing else: not the output, not the folder."""
    import os
    import sys

    from conftest import REPO
    from hub_stub import HubStub

    token = "hf_test_token_not_real"
    out = tmp_path / "hf"
    with HubStub() as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": token,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": str(REPO),
        }
        proc = run_watched(
            [
                sys.executable,
                "-m",
                "muloco.export",
                str(ar_run),
                "--out",
                str(out),
                "--push-to-hub",
                "me/tiny-llama",
                "--private",
            ],
            env=env,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"pushed to the Hub as me/tiny-llama: {hub.url}/me/tiny-llama/commit/" in proc.stdout
    assert not hub.unexpected and hub.created[0]["visibility"] == "private" and len(hub.cards) == 1
    assert hub.authorizations == {f"Bearer {token}"}
    local = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert hub.files["me/tiny-llama"] == local and "model.safetensors" in local
    assert token not in proc.stdout + proc.stderr and not any(token.encode() in b for b in local.values())

    with HubStub() as hub:  # --private onto a repository that exists and is public: refused, nothing sent
        hub.public.add("me/public-one")
        env = {**env, "HF_ENDPOINT": hub.url}
        proc = run_watched(
            [
                sys.executable,
                "-m",
                "muloco.export",
                str(ar_run),
                "--out",
                str(tmp_path / "again"),
                "--push-to-hub",
                "me/public-one",
                "--private",
            ],
            env=env,
        )
    assert proc.returncode == 2 and "exists and is public" in proc.stderr and not hub.files, proc.stderr[-2000:]

    home = tmp_path / "hf-home"  # the token `hf auth login` saved, without HF_TOKEN
    home.mkdir()
    (home / "token").write_text("hf_saved_token_not_real")
    with HubStub() as hub:
        env = {k: v for k, v in {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home)}.items() if k != "HF_TOKEN"}
        proc = run_watched(
            [
                sys.executable,
                "-m",
                "muloco.export",
                str(ar_run),
                "--out",
                str(tmp_path / "saved"),
                "--push-to-hub",
                "me/saved-token",
            ],
            env=env,
        )
    assert proc.returncode == 0 and hub.authorizations == {"Bearer hf_saved_token_not_real"}, proc.stderr[-2000:]

    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)  # no token anywhere: one error before anything is written
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert main([str(ar_run), "--out", str(tmp_path / "none"), "--push-to-hub", "me/tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert "hf auth login" in err and "export HF_TOKEN=" in err and not (tmp_path / "none").exists()
    monkeypatch.setenv("HF_TOKEN", token)  # a name the Hub refuses: refused before the export is written
    assert main([str(ar_run), "--out", str(tmp_path / "none"), "--push-to-hub", "someone/bad name!"]) == 2
    assert "is not a valid Hub repository name" in capsys.readouterr().err and not (tmp_path / "none").exists()
