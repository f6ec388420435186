"""Entry point: ``python -m muloco.train --config <module> [--section.key value ...]``.

Runs under torchrun, under a job scheduler, or as a plain process (then it is a
single-rank job on 127.0.0.1). Bad input stops the run before anything is written,
with one message and exit status 2.
"""

from __future__ import annotations

import os
import sys

from muloco import compat

compat.apply()

import torch  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

from muloco.checkpoint import CheckpointLoadError  # noqa: E402
from muloco.config.checks import check_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.launch.ports import free_port  # noqa: E402
from muloco.outer.manager import ReplicaGroupError  # noqa: E402

EXIT_BAD_INPUT = 2
EXIT_BAD_CHECKPOINT = 3
EXIT_REPLICA_GROUP = 4


def ensure_single_process_env() -> None:
    """A plain `python -m muloco.train` is a world of one, bound to loopback."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def preflight(config) -> None:
    """Everything that can be checked without building the trainer."""
    from muloco.data.tokenizer import TokenizerError

    check_config(config)
    try:
        config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    except TokenizerError as err:
        raise ConfigError(str(err)) from None


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from muloco.data.corpus import DataError
    from muloco.data.tokenizer import TokenizerError

    return (ConfigError, DataError, TokenizerError)


def run(argv: list[str] | None = None) -> dict:
    _, config = parse_args(argv)
    preflight(config)
    ensure_single_process_env()
    trainer = None
    try:
        trainer = config.build()
        trainer.train()
        return trainer.summary
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        run(argv)
    except _bad_input_errors() as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except CheckpointLoadError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_CHECKPOINT
    except ReplicaGroupError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_REPLICA_GROUP
    return 0


if __name__ == "__main__":
    sys.exit(main())
