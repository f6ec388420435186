"""Config modules, composition, overrides, and every kind of bad input."""

from __future__ import annotations

import pytest

from muloco import compat

compat.apply()

from conftest import run_train  # noqa: E402

from muloco.config import ConfigError, load_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.train import main  # noqa: E402


def test_config_modules_compose():
    base, ddp = load_config("base"), load_config("ddp/adamw")
    assert type(base).__name__ == "Config" and base.model.flavor == ddp.model.flavor
    assert ddp.training.steps != base.training.steps  # the child changed a field
    assert ddp.training.seq_len == base.training.seq_len  # and inherited the rest
    for spelling in ("ddp.adamw", "config/ddp/adamw.py"):
        assert load_config(spelling).training.steps == ddp.training.steps


def test_config_module_by_path(tmp_path):
    mod = tmp_path / "mine.py"
    mod.write_text(
        "from muloco.config import load_config\n"
        "def config():\n    c = load_config('ddp/adamw')\n    c.training.steps = 7\n    return c\n"
    )
    _, c = parse_args(["--config", str(mod)])
    assert c.training.steps == 7


def test_dotted_overrides_reach_every_section():
    _, c = parse_args(
        [
            "--config",
            "ddp/adamw",
            "--optimizer.lr",
            "0.01",
            "--training.seq_len",
            "32",
            "--model.flavor",
            "llama3-w64-d2-h2",
            "--objective",
            "mdlm",
            "--objective.eps",
            "0.01",
            "--dataloader.source.val-percent",
            "7",
            "--metrics.jsonl_file",
            "m.jsonl",
            "--validator.steps",
            "3",
            "--checkpoint.no-enable",
        ]
    )
    assert c.optimizer.lr == 0.01 and c.training.seq_len == 32
    assert c.model.flavor == "llama3-w64-d2-h2" and c.objective.eps == 0.01
    assert c.dataloader.source.val_percent == 7 and c.metrics.jsonl_file == "m.jsonl"
    assert c.validator.steps == 3 and c.checkpoint.enable is False


@pytest.mark.parametrize(
    "bad, suggestion",
    [
        ("--optimizer.lrr", "--optimizer.lr"),
        ("--training.seqlen", "--training.seq_len"),
        ("--modle.flavor", "--model.flavor"),
        ("--optimizer.learning_rate", "--optimizer.lr"),
        ("--optimizer.wd", "--optimizer.weight_decay"),
    ],
)
def test_unknown_key_names_closest_valid_keys(bad, suggestion):
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", "base", bad, "1"])
    assert bad.lstrip("-") in str(err.value) and f"Closest valid keys: {suggestion}" in str(err.value)  # first


def test_unknown_config_module_lists_available():
    with pytest.raises(ConfigError, match="ddp/adamw"):
        parse_args(["--config", "ddp/adamww"])


BAD_INPUTS = [
    (["--optimizer.lr", "0"], "optimizer.lr"),
    (["--optimizer.lr", "-1e-3"], "optimizer.lr"),
    (["--training.seq_len", "0"], "training.seq_len"),
    (["--training.seq_len", "-5"], "training.seq_len"),
    (["--training.local_batch_size", "0"], "training.local_batch_size"),
    (["--model.flavor", "llama3-w100-d3-h3"], "model.flavor"),
    (
        ["--dataloader.source", "jsonl", "--dataloader.source.dataset_path", "/no/such/data.jsonl"],
        "dataloader.source.dataset_path",
    ),
    (["--tokenizer.path", "/no/such/tokenizer.model"], "tokenizer.path"),
    (["--optimizer.lrr", "1e-3"], "optimizer.lr"),
    # a data setting of another source than the chosen one, and torchtitan's unread loader keys
    (
        ["--dataloader.source.dataset_path", "x.jsonl"],
        "dataset_path belongs to jsonl or huggingface or sft: pick it with --dataloader.source jsonl",
    ),
    (
        ["--dataloader.source", "jsonl", "--dataloader.source.dataset_subset", "s"],
        "jsonl, which has no setting 'dataset_subset'",
    ),
    (["--dataloader.dataset_path", "x.jsonl"], "use --dataloader.source jsonl --dataloader.source.dataset_path PATH"),
    (["--dataloader.format", "sft"], "SFT rows are a data source now: --dataloader.source sft"),
    (["--validator.tuning_steps", "-1"], "validator.tuning_steps is -1"),
    (["--validator.tuning_steps", "4", "--validator.steps", "-1"], "give validator.steps a count"),
    (["--outer.step_schedule.lr.decay", "cosine"], "outer.step_schedule"),  # a run without an outer loop
]


@pytest.mark.parametrize("args, key", BAD_INPUTS)
def test_bad_input_stops_before_writing(tmp_path, capsys, args, key):
    out = tmp_path / "run"
    code = main(["--config", "base", "--dump_folder", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert key in err and err.count("error:") == 1, err
    assert not out.exists(), "bad input left output behind"


def test_corrupt_tokenizer_is_bad_input(tmp_path, capsys):
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(b"\x00\xffnot a bpe file\n\x13")
    out = tmp_path / "run"
    assert main(["--config", "base", "--tokenizer.path", str(tok), "--dump_folder", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(tok) in err and not out.exists()


def test_bad_input_exit_status_from_the_command_line(tmp_path):
    proc = run_train(["--config", "base", "--optimizer.lr", "0", "--dump_folder", str(tmp_path / "x")], quiet_s=120)
    assert proc.returncode == 2
    assert "optimizer.lr" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_options_with_defaults():
    proc = run_train(["--config", "base", "--help"], quiet_s=120)
    assert proc.returncode == 0
    for key in (
        "--optimizer.lr",
        "--model.flavor",
        "--dataloader.source",
        "--training.seq-len",
        "--metrics.jsonl-file",
        "--validator.follow-training-data",
    ):
        assert key in proc.stdout.replace("_", "-"), key
    assert "default" in proc.stdout.lower()


def test_codec_and_strategy_are_picked_by_name_and_set_by_their_own_keys():
    from muloco.compress import Dense, Quantizer, TopK
    from muloco.outer.exchange import ReduceScatter

    _, c = parse_args(
        [
            "--config",
            "diloco/diloco",
            "--outer.exchange.codec",
            "quantize",
            "--outer.exchange.codec.bits",
            "4",
            "--outer.exchange.strategy=reduce_scatter",
        ]
    )
    assert c.outer.exchange.codec == Quantizer.Config(bits=4) and isinstance(
        c.outer.exchange.strategy, ReduceScatter.Config
    )
    # picking the codec the config module set keeps its settings; the order of the flags does not matter
    _, c = parse_args(
        [
            "--config",
            "diloco/muloco_topk",
            "--outer.exchange.codec.fraction",
            "0.2",
            "--outer.exchange.codec",
            "topk",
            "--outer.exchange.strategy",
            "auto",
        ]
    )
    assert c.outer.exchange.codec == TopK.Config(fraction=0.2) and c.outer.exchange.strategy is None
    _, c = parse_args(
        [
            "--config",
            "diloco/muloco_2bit",
            "--outer.exchange.codec",
            "dense",
            "--outer.exchange.codec.dtype",
            "bfloat16",
        ]
    )
    assert c.outer.exchange.codec == Dense.Config(dtype="bfloat16")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--outer.exchange.codec.fraction", "0.1"],
            "outer.exchange.codec is quantize, which has no setting 'fraction' (its settings: bits, scheme, "
            "block_size, range_sigmas, statistics, mean_at, sample_sigma); fraction belongs to topk: pick it with "
            "--outer.exchange.codec topk.",
        ),
        (
            ["--outer.exchange.bits", "4"],
            "did you mean --outer.exchange.codec.bits (a setting of outer.exchange.codec quantize)?",
        ),
        (
            ["--outer.exchange.strategy", "ring"],
            "--outer.exchange.strategy must be one of allreduce, allgather, reduce_scatter, auto; got 'ring'.",
        ),
    ],
)
def test_a_setting_of_another_variant_names_the_chosen_one(args, message):
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", "diloco/muloco_2bit", *args])
    assert message in str(err.value)


def test_a_variant_switch_keeps_only_what_its_common_config_carries():
    """``--objective mdlm`` on a next-token config gets masked diffusion's own defaults (its document
    mask on), not the AR config's values of the fields both objectives have; the outer optimizers
    carry their lr and momentum (``carried_on_switch``) and nothing else is carried."""
    _, config = parse_args(["--config", "diloco/diloco", "--objective", "mdlm"])
    assert config.objective.document_mask is True
    _, config = parse_args(["--config", "diffusion/muloco", "--objective", "ar"])
    assert config.objective.document_mask is False
    _, config = parse_args(["--config", "diloco/diloco", "--outer.optimizer.lr", "0.3", "--outer.optimizer", "sgd"])
    assert (config.outer.optimizer.lr, config.outer.optimizer.momentum) == (0.3, 0.9)
