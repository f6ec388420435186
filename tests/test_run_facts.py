"""The facts a run records about itself (``muloco.runs.facts``), from every shipped config module."""

from __future__ import annotations

import json

import pytest

from muloco import compat

compat.apply()

from muloco.config import load_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import available_configs  # noqa: E402
from muloco.runs.facts import FACT_KEYS, facts_of, method_of, missing_facts, source_commit, update_run_record  # noqa: E402

EXPECTED_METHOD = {
    "base": "ddp-adamw",
    "ddp/adamw": "ddp-adamw",
    "ddp/muon": "ddp-muon",
    "diloco/diloco": "diloco",
    "diloco/diloco_2bit": "diloco-2bit",
    "diloco/diloco_streaming": "diloco-streaming",
    "diloco/muloco": "muloco",
    "diloco/muloco_2bit": "muloco-2bit",
    "diloco/muloco_4bit": "muloco-4bit",
    "diloco/muloco_topk": "muloco-topk",
    "diloco/muloco_streaming": "muloco-streaming",
    "diloco/sparseloco": "muloco-topk",
    "diloco/sparseloco_published": "diloco-topk",
    "diffusion/ddp_adamw": "ddp-adamw",
    "diffusion/ddp_muon": "ddp-muon",
    "diffusion/muloco": "muloco",
    "diffusion/muloco_2bit": "muloco-2bit",
    "diffusion/sft": "ddp-adamw",
    "gpu/ddp_adamw": "ddp-adamw",
    "gpu/ddp_muon": "ddp-muon",
    "gpu/diloco": "diloco",
    "gpu/muloco": "muloco",
    "gpu/muloco_2bit": "muloco-2bit",
}


def test_every_shipped_config_has_an_expected_method():
    assert sorted(EXPECTED_METHOD) == available_configs(), "a new config module needs its method here"


@pytest.mark.parametrize("name", sorted(EXPECTED_METHOD))
def test_the_method_comes_from_the_resolved_config(name):
    config = load_config(name)
    facts = facts_of(config, environment=False)
    assert facts["method"] == method_of(facts) == EXPECTED_METHOD[name]
    assert facts["objective"] == ("mdlm" if name.startswith("diffusion/") else "ar")
    assert set(FACT_KEYS) - {"versions", "commit"} <= set(facts)
    json.dumps(facts)  # what run.json holds must serialise
    if hasattr(config, "outer"):
        outer = facts["outer"]
        assert outer["replica_groups"] == config.fault_tolerance.group_size
        assert outer["sync_every"] == config.outer.sync_every and outer["fragments"] == config.outer.num_fragments
        assert outer["strategy"] in ("allreduce", "allgather", "reduce_scatter")
    else:
        assert facts["outer"] is None


def test_overrides_change_the_facts_not_the_module_name():
    _, config = parse_args(
        [
            "--config",
            "diloco/diloco",
            "--optimizer.name",
            "Muon",
            "--outer.exchange.codec",
            "quantize",
            "--outer.exchange.codec.bits",
            "4",
            "--outer.exchange.error_feedback.no-enabled",
            "--outer.num_fragments",
            "3",
            "--fault_tolerance.group_size",
            "4",
            "--outer.exchange.weighting",
            "tokens",
        ]
    )
    facts = facts_of(config, environment=False)
    assert facts["method"] == "muloco-4bit-streaming"
    outer = facts["outer"]
    assert outer["codec"]["bits"] == 4 and outer["error_feedback"]["enabled"] is False
    assert outer["weighting"] == "tokens" and facts_of(load_config("diloco/diloco"))["outer"]["weighting"] == "equal"
    assert outer["round"]["mode"] == "lockstep"
    _, config = parse_args(
        ["--config", "diloco/muloco_2bit", "--outer.round", "deadline", "--outer.round.max_steps", "90"]
    )
    facts = facts_of(config, environment=False)
    assert facts["method"] == "muloco-2bit-deadline" and facts["outer"]["round"]["max_steps"] == 90
    assert facts["outer"]["round"]["mode"] == "deadline" and facts["outer"]["weighting"] == "tokens"  # auto
    assert outer["replica_groups"] == 4 and outer["fragments"] == 3


def test_a_dense_fp32_exchange_has_no_error_feedback_and_32_bits():
    facts = facts_of(load_config("diloco/diloco"), environment=False)
    assert facts["outer"]["codec"] == {
        "name": "dense",
        "bits": 32,
        "tag": "",
        "detail": "",
        "lossless": True,
        "dtype": "float32",
    }
    assert facts["outer"]["error_feedback"]["enabled"] is False


def test_data_facts_hold_only_what_the_source_reads():
    _, config = parse_args(
        ["--config", "ddp/adamw", "--dataloader.source", "jsonl", "--dataloader.source.dataset_path", "/data/x.jsonl"]
    )
    data = facts_of(config, environment=False)["data"]
    assert data["source"] == "jsonl" and data["dataset_path"] == "/data/x.jsonl"
    assert "dataset_subset" not in data and "prompt_field" not in data


def test_environment_facts_name_versions_and_the_commit():
    facts = facts_of(load_config("ddp/adamw"))
    assert facts["versions"]["torch"].startswith("2.13.0") and facts["versions"]["torchft"]
    commit = source_commit()
    assert facts["commit"] == commit
    if commit is not None:  # a git checkout (CI's fresh clone is one)
        assert len(commit["sha"]) == 40 and isinstance(commit["dirty"], bool)


def test_an_older_run_json_is_missing_every_fact_and_a_record_keeps_what_it_holds(tmp_path):
    assert missing_facts(None) == list(FACT_KEYS)
    update_run_record(tmp_path, config="/x/config/ddp/adamw.py", args=["--training.steps", "2"], cwd="/x")
    assert missing_facts(json.loads((tmp_path / "run.json").read_text())) == list(FACT_KEYS)
    update_run_record(tmp_path, facts=facts_of(load_config("ddp/adamw")))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["args"] == ["--training.steps", "2"] and missing_facts(record) == []
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"], "written atomically, no temp file left"


@pytest.mark.parametrize("name", ["diloco/muloco_2bit", "diloco/sparseloco", "diloco/diloco"])
def test_a_run_recorded_before_codecs_stated_their_tag_is_named_as_then(name):
    """``run.json`` files of facts version 1 hold a codec's name and settings, no ``tag``: the report
    still names their method as it did when they were written."""
    facts = facts_of(load_config(name), environment=False)
    for key in ("tag", "detail", "lossless"):
        del facts["outer"]["codec"][key]
    assert method_of(facts) == EXPECTED_METHOD[name]
