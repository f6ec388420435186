"""Entry point: ``python -m muloco.train --config <module> [--section.key value ...]``.

Runs under torchrun, under a job scheduler, or as a plain process (then it is a
single-rank job on 127.0.0.1). Bad input stops the run before anything is written,
with one message and its exit status (``utils/errors.py``: 2 bad input, 3 a checkpoint that
cannot be loaded, 4 and 5 a replica group lost or out of date).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from muloco import compat

compat.apply()

import torch  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402

from muloco.components.checkpoint import check_loadable, run_folder  # noqa: E402
from muloco.components.preemption import EXIT_PREEMPTED, RunPreempted  # noqa: E402
from muloco.config.checks import check_config, check_dump_folder  # noqa: E402
from muloco.config.cli import parse_args, split_config_arg  # noqa: E402
from muloco.config.held_out import check_held_out_rows  # noqa: E402
from muloco.config.loader import ConfigError, resolve_config_path  # noqa: E402
from muloco.config.run_length import resolve_run_length  # noqa: E402
from muloco.data.loader import check_readable  # noqa: E402
from muloco.data.tokenizer import TokenizerError  # noqa: E402
from muloco.outer.manager import ReplicaGroupError, wait_until_reachable  # noqa: E402
from muloco.runs.facts import RUN_FILE, facts_of, update_run_record  # noqa: E402
from muloco.runs.lives import Lives  # noqa: E402
from muloco.runs.lock import DumpFolderBusy, DumpFolderLock  # noqa: E402
from muloco.utils.command_line import failed, run_main  # noqa: E402
from muloco.utils.errors import OUT_OF_DATE, REPLICA_GROUP, MulocoError  # noqa: E402
from muloco.utils.interfaces import is_ipv4  # noqa: E402
from muloco.utils.ports import free_port  # noqa: E402


def ensure_single_process_env(address: str = "127.0.0.1") -> None:
    """A plain `python -m muloco.train` is a world of one, its store on loopback, or on the address
    the group advertises (the other groups' collectives meet at the store of one of them)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=address,
        MASTER_PORT=str(free_port()),
    )


def preflight(config) -> None:
    """Everything that can be checked without building the trainer, so that bad input
    (exit 2) and an unusable checkpoint (exit 3) stop the run before it writes anything."""
    check_config(config)
    check_dump_folder(config.dump_folder)
    _check_tokenizer(config)
    _check_data(config)
    resolve_run_length(config)
    check_held_out_rows(config, int(os.environ.get("WORLD_SIZE", "1")))
    step = check_loadable(config)
    if step >= 0:
        _check_same_run(config, step)
    _check_same_kind(config)
    _check_lives(config)
    _check_lighthouse(config)  # last: it may wait for a lighthouse that starts after this replica


def _recorded_facts(folder: str | Path) -> dict | None:
    """The facts a folder's ``run.json`` recorded (None: no readable record of them)."""
    import json

    try:
        facts = json.loads((Path(folder) / RUN_FILE).read_text()).get("facts")
    except (OSError, ValueError, AttributeError):
        return None
    return facts if isinstance(facts, dict) else None


def _check_same_kind(config) -> None:
    """A DiLoCo job writes one ``replica_<i>/`` folder per group under its dump folder, a DDP run its
    files straight into it: one pointed at the other's folder would mix two runs and resume neither."""
    folder = Path(config.dump_folder)
    if hasattr(config, "outer"):
        theirs = _recorded_facts(folder)
        if theirs is not None and theirs.get("outer", "?") is None:
            raise ConfigError(
                f"{folder} holds a DDP run ({theirs.get('method', 'no outer loop')}), and this "
                "DiLoCo job would write its replica groups' folders into it: give a new --dump_folder"
            )
    elif any(p.is_dir() and (p / RUN_FILE).is_file() for p in folder.glob("replica_*")):
        raise ConfigError(
            f"{folder} holds a DiLoCo job (replica_<i>/ folders), and this DDP run would write "
            "beside them: give a new --dump_folder"
        )


def _check_lives(config) -> None:
    """A replica group's ledger of its lives (``runs/lives.py``) must read before a new life joins it."""
    if hasattr(config, "outer"):
        try:
            Lives.read(run_folder(config))
        except ValueError as err:
            raise ConfigError(str(err)) from None


SAME_RUN_FACTS = (
    ("model.flavor", ("model", "flavor")),
    ("objective", ("objective",)),
    ("optimizer.name", ("inner_optimizer", "name")),
    ("method", ("method",)),
    ("dataloader.source", ("data", "source")),
)
"""What a resumed folder's ``run.json`` and this command must agree on for its checkpoint to load."""


def _check_same_run(config, step: int) -> None:
    """A folder resumed from its checkpoint must hold a run of this config: another flavor or
    method would fail deep in the load ("size mismatch", "missing key momentum_buffer")."""
    folder = run_folder(config)
    theirs = _recorded_facts(folder)
    if theirs is None:
        return  # no readable record: the checkpoint's own load says what does not fit
    ours = facts_of(config, environment=False)
    for label, path in SAME_RUN_FACTS:
        there, here = theirs, ours
        for key in path:
            there = there.get(key) if isinstance(there, dict) else None
            here = here.get(key) if isinstance(here, dict) else None
        if there is not None and str(there).lower() != str(here).lower():
            raise ConfigError(
                f"{folder} holds a run of another config ({label} {there} there, {here} here), "
                f"and this command would resume its checkpoint step-{step}: resume it with the "
                f"settings in its {RUN_FILE}, or give a new --dump_folder (to start from its weights: "
                f"--checkpoint.initial_load_path {folder}/{config.checkpoint.folder}/step-{step})"
            )


def _check_lighthouse(config) -> None:
    """A DiLoCo replica needs a lighthouse address that is a URL (else bad input, exit 2), and
    the lighthouse must answer within the connect timeout before the run writes anything (else
    ReplicaGroupError, exit 4, and no ``run.json`` or empty folders left behind). A replica
    started before its lighthouse waits here for it."""
    if not hasattr(config, "outer"):
        return
    ft = config.fault_tolerance
    try:
        url = ft.lighthouse_url()
    except ReplicaGroupError as err:
        raise ConfigError(str(err)) from None
    wait_until_reachable(url, ft.replica_id, ft.connect_timeout_seconds)


def _lock_run_folder(config) -> DumpFolderLock | None:
    """One live run per output folder: rank 0 of this process group locks the folder it
    writes (a DiLoCo replica group its own ``replica_<id>/``; the local launcher locks the
    dump folder above them)."""
    if os.environ.get("RANK", "0") != "0":
        return None
    try:
        return DumpFolderLock(run_folder(config)).acquire()
    except DumpFolderBusy as err:
        raise ConfigError(str(err)) from None


def _check_tokenizer(config) -> None:
    try:
        config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    except TokenizerError as err:
        raise ConfigError(str(err)) from None


def _check_data(config) -> None:
    """Every split the run reads: training, and the held-out data the validator will
    read (a Hugging Face source is contacted only when it is the configured one)."""
    check_readable(config.dataloader)
    if config.validator.enable:
        prefix = "dataloader" if config.validator.follow_training_data else "validator.dataloader"
        check_readable(config.validator.data_config(config.dataloader), prefix)


def _record_command(name: str, argv: list[str], config) -> None:
    """Rank 0 writes the command (config module, overrides, working directory) into the run
    folder's ``run.json``; the trainer adds the run's facts once its model is built."""
    if os.environ.get("RANK", "0") != "0":
        return
    update_run_record(run_folder(config), config=str(resolve_config_path(name)), args=argv, cwd=os.getcwd())


def run(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    name, config = parse_args(argv)
    preflight(config)
    lock = _lock_run_folder(config)
    _record_command(name, split_config_arg(argv)[1], config)
    advertised = getattr(getattr(config, "fault_tolerance", None), "advertise_address", "")
    ensure_single_process_env(advertised if is_ipv4(advertised) else "127.0.0.1")
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
        if lock is not None:
            lock.release()


def _exit_now(status: int) -> NoReturn:
    """Leave without interpreter teardown: torchft's quorum thread may still sit in a call to a
    lighthouse that is gone (Python would wait for it at exit, up to the quorum timeout), and
    gloo's threads calling back into a finalizing interpreter can abort a finished run
    ("terminate called without an active exception", exit 134, seen in test workers)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        run(argv)
    except MulocoError as err:
        status = failed("train", err)
        if status in (REPLICA_GROUP, OUT_OF_DATE):  # torchft's quorum thread may hang interpreter teardown
            _exit_now(status)
        return status
    except RunPreempted as err:
        print(f"muloco: {err}", file=sys.stderr, flush=True)
        _exit_now(EXIT_PREEMPTED)  # the job script requeues the job on this status
    return 0


def command(argv: list[str] | None = None) -> NoReturn:
    """The train command (``python -m muloco.train``, ``muloco train``): its files are closed
    and its lock released when ``main`` returns, so it leaves without interpreter teardown."""
    _exit_now(main(argv))


if __name__ == "__main__":
    run_main(command)  # a --help cut short by its reader ends quietly
