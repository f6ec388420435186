"""Smoke tests: everything a user can run is run once in CI, cheaply, and COVERAGE names the test
that runs each user-runnable thing (here or in another test file).

A new job script, sweep, config module, ``python -m muloco.*`` entry point, benchmark or top-level
executable without a row in COVERAGE fails ``test_everything_user_runnable_is_in_the_coverage_table``
(and a row whose test does not exist fails ``test_every_test_the_table_names_exists``).

Cheap: the tiny flavor (``llama3-w64-d2-h2``, seq 64, batch 4), 2 or 3 steps, no checkpoints and no
validation where they are not what is tested, one replica group. The expensive runs start together
in the background when this module starts, two at a time (CI has 2 cores), while the in-process
tests run; each test waits for its own run. Every process is started in a session of its own and,
if still running when the module ends, killed by its PID.

What needs no process boundary shares a process: the configs train one after another in one
Python process (``python tests/test_smoke.py train ...``); every entry point's ``--help`` and the
dry runs the SLURM wrappers and the 8-GPU node script would start run in one other
(``python tests/test_smoke.py modules ...``), after the scripts themselves ran with a recorder in
place of their Python (what they would run is checked, then run there); the sweep files run as
``__main__`` inside pytest. The local job scripts, jobs/slurm/submit.sh and ./torchft_lighthouse
run as they are.

SLURM scripts and sweeps run as dry runs against a fake ``sinfo`` (one ``gpu`` partition of 8 nodes
with 8 GPUs each), so they are placed as on a GPU cluster whether or not this machine has SLURM;
submitting to a real SLURM is tests/test_slurm_jobs.py's.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, TINY, Watched
from in_process import recorded_python

THIS = "tests/test_smoke.py"

# -- what runs here ------------------------------------------------------------------------------

LOCAL_SCRIPTS = {  # jobs/local/<script> -> (its default config, objective)
    "diloco.sh": ("diloco/diloco", "ar"),
    "muloco.sh": ("diloco/muloco_2bit", "ar"),
    "diffusion.sh": ("diffusion/muloco_2bit", "mdlm"),
}

SLURM_GROUPS = ["muloco.launch.slurm.group", "muloco.launch.lighthouse"]
SLURM_SCRIPTS = {  # jobs/slurm/<script> -> (kind, config, extra arguments, the `-m` modules its jobs run)
    "ddp.sh": ("ddp", "gpu/ddp_muon", [], ["torch.distributed.run", "muloco.train"]),
    "diffusion.sh": ("groups", "diffusion/muloco_2bit", [], ["muloco.launch.local"]),
    "diloco.sh": ("groups", "gpu/diloco", [], ["muloco.launch.local"]),
    "muloco.sh": ("groups", "gpu/muloco_2bit", [], ["muloco.launch.local"]),
    "muloco_ft_array.sh": ("array", "gpu/muloco_2bit", [], SLURM_GROUPS),
    "muloco_multinode.sh": ("spanning", "gpu/muloco_2bit", [], SLURM_GROUPS),
    # what the others end in, here with a kind and config of its own
    "submit.sh": ("spanning", "diloco/muloco_topk", ["--replicas", "3", "--nodes-per-replica", "2"], SLURM_GROUPS),
}

SWEEPS = sorted(p.stem for p in (REPO / "jobs" / "sweeps").glob("*.py") if not p.name.startswith("_"))

# Configs no end-to-end test elsewhere trains (the others: see COVERAGE). Each trains 2 steps, a
# replica-group config as one group with a sync every step; the streaming ones keep their 3
# fragments and τ=2, so H=9 and 3 steps (one fragment exchange started at step 1, applied at 3).
CONFIGS_TRAINED_HERE = [
    "diffusion/muloco",
    "diffusion/sft",
    "diloco/diloco_2bit",
    "diloco/diloco_streaming",
    "diloco/muloco",
    "diloco/muloco_4bit",
    "diloco/muloco_streaming",
    "diloco/muloco_topk",
    "diloco/sparseloco_published",
    "gpu/ddp_adamw",
    "gpu/diloco",
    "gpu/muloco",
]
STREAMING = {"diloco/diloco_streaming", "diloco/muloco_streaming"}


def _entry_points() -> list[str]:
    """Every ``python -m muloco.X``: a ``__main__.py`` or a module with a top-level main guard."""
    guard = re.compile(r"^if __name__ == ['\"]__main__['\"]\s*:", re.M)
    found = []
    for path in sorted((REPO / "muloco").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        if path.name == "__main__.py":
            found.append(".".join(rel.parts[:-1]))
        elif guard.search(path.read_text()):
            found.append(".".join(rel.parts))
    return found


ENTRY_POINTS = _entry_points()
HELP_ARGS: dict[str, list[str]] = {}  # an entry point whose help is asked for otherwise than --help

# Whatever runs here by parametrised test: {test function: its parameter ids}.
PARAMS = {
    "test_local_job_script": list(LOCAL_SCRIPTS),
    "test_slurm_script_dry_run": list(SLURM_SCRIPTS),
    "test_sweep_dry_run": SWEEPS,
    "test_config_trains": CONFIGS_TRAINED_HERE,
    "test_entry_point_help": ENTRY_POINTS,
}

# -- the coverage table --------------------------------------------------------------------------
# Every user-runnable thing -> the test(s) that run it. Tests elsewhere are named by function
# (any of their parameters runs it); tests here by their node id. An entry point needs two: its
# --help (here) and one real invocation.

BENCH_TEST = "tests/test_bench_smoke.py::test_bench_smoke"  # over bench/*.py: `--smoke` runs, libraries checked

SLURM_REAL = "tests/test_slurm_jobs.py::test_interactive_node_scripts_run_inside_an_allocation"
SLURM_ARRAY = "tests/test_slurm_jobs.py::test_array_layout_a_requeued_group_heals_while_the_other_keeps_training"
COVERAGE: dict[str, str | tuple[str, ...]] = {
    # job scripts
    "jobs/local/diloco.sh": f"{THIS}::test_local_job_script[diloco.sh]",
    "jobs/local/muloco.sh": f"{THIS}::test_local_job_script[muloco.sh]",
    "jobs/local/diffusion.sh": f"{THIS}::test_local_job_script[diffusion.sh]",
    "jobs/local/convert.sh": "tests/test_convert_job.py::test_the_convert_script_turns_its_ar_export_into_a_lora_diffusion_model_under_k2_muloco",  # noqa: E501 (a test id)
    "jobs/ddp/run.sh": SLURM_REAL,  # under srun in a real local SLURM
    "jobs/diloco/workers.sh": SLURM_REAL,
    "jobs/diloco/8workers_x1gpu.sh": f"{THIS}::test_eight_gpu_node_script_dry_run",
    "jobs/slurm/ddp.sh": f"{THIS}::test_slurm_script_dry_run[ddp.sh]",
    "jobs/slurm/diffusion.sh": f"{THIS}::test_slurm_script_dry_run[diffusion.sh]",
    "jobs/slurm/diloco.sh": f"{THIS}::test_slurm_script_dry_run[diloco.sh]",
    "jobs/slurm/muloco.sh": f"{THIS}::test_slurm_script_dry_run[muloco.sh]",
    "jobs/slurm/muloco_ft_array.sh": f"{THIS}::test_slurm_script_dry_run[muloco_ft_array.sh]",
    "jobs/slurm/muloco_multinode.sh": f"{THIS}::test_slurm_script_dry_run[muloco_multinode.sh]",
    "jobs/slurm/submit.sh": f"{THIS}::test_slurm_script_dry_run[submit.sh]",
    # sweeps
    "jobs/sweeps/ddp_baselines.py": f"{THIS}::test_sweep_dry_run[ddp_baselines]",
    "jobs/sweeps/diffusion.py": f"{THIS}::test_sweep_dry_run[diffusion]",
    "jobs/sweeps/diffusion_outer.py": f"{THIS}::test_sweep_dry_run[diffusion_outer]",
    "jobs/sweeps/diloco_vs_muloco.py": f"{THIS}::test_sweep_dry_run[diloco_vs_muloco]",
    "jobs/sweeps/muloco_compression.py": f"{THIS}::test_sweep_dry_run[muloco_compression]",
    "jobs/sweeps/tiny_cpu.py": f"{THIS}::test_sweep_dry_run[tiny_cpu]",
    # configs (each trains a few steps)
    "config/base.py": "tests/test_training.py::test_loss_falls_on_embedded_corpus",
    "config/ddp/adamw.py": "tests/test_report.py::test_table_rows_match_each_runs_summary",
    "config/ddp/muon.py": "tests/test_muon.py::test_fsdp_two_ranks_train_with_sharded_muon",
    "config/diffusion/ddp_adamw.py": "tests/test_report.py::test_table_rows_match_each_runs_summary",
    "config/diffusion/ddp_muon.py": "tests/test_slurm_jobs.py::test_ddp_diffusion_job_runs_to_completion_under_slurm",
    "config/diffusion/muloco.py": f"{THIS}::test_config_trains[diffusion/muloco]",
    "config/diffusion/muloco_2bit.py": f"{THIS}::test_local_job_script[diffusion.sh]",
    "config/diffusion/sft.py": f"{THIS}::test_config_trains[diffusion/sft]",
    "config/diloco/diloco.py": "tests/test_diloco.py::test_replicas_train_and_hold_identical_global_params_after_every_sync",  # noqa: E501 (a test id)
    "config/diloco/diloco_2bit.py": f"{THIS}::test_config_trains[diloco/diloco_2bit]",
    "config/diloco/diloco_streaming.py": f"{THIS}::test_config_trains[diloco/diloco_streaming]",
    "config/diloco/muloco.py": f"{THIS}::test_config_trains[diloco/muloco]",
    "config/diloco/muloco_2bit.py": "tests/test_diloco.py::test_sharded_replicas_compress_their_shards_and_resume",
    "config/diloco/muloco_4bit.py": f"{THIS}::test_config_trains[diloco/muloco_4bit]",
    "config/diloco/muloco_streaming.py": f"{THIS}::test_config_trains[diloco/muloco_streaming]",
    "config/diloco/muloco_topk.py": f"{THIS}::test_config_trains[diloco/muloco_topk]",
    "config/diloco/sparseloco.py": "tests/test_compare.py::test_two_run_suite_end_to_end_then_reused",
    "config/diloco/sparseloco_published.py": f"{THIS}::test_config_trains[diloco/sparseloco_published]",
    "config/gpu/ddp_adamw.py": f"{THIS}::test_config_trains[gpu/ddp_adamw]",
    "config/gpu/ddp_muon.py": "tests/test_gpu_presets.py::test_single_group_preset_trains_on_cpu_with_the_tiny_override",  # noqa: E501 (a test id)
    "config/gpu/diloco.py": f"{THIS}::test_config_trains[gpu/diloco]",
    "config/gpu/muloco.py": f"{THIS}::test_config_trains[gpu/muloco]",
    "config/gpu/muloco_2bit.py": "tests/test_gpu_presets.py::test_replica_group_preset_trains_on_cpu_with_the_tiny_override",  # noqa: E501 (a test id)
    # python -m entry points: (--help, a real invocation)
    "muloco": (
        f"{THIS}::test_entry_point_help[muloco]",
        "tests/test_commands.py::test_muloco_runs_the_command_asked_for_and_suggests_for_a_typo",
    ),
    "muloco.compare": (
        f"{THIS}::test_entry_point_help[muloco.compare]",
        "tests/test_compare.py::test_two_run_suite_end_to_end_then_reused",
    ),
    "muloco.data.fetch": (
        f"{THIS}::test_entry_point_help[muloco.data.fetch]",
        "tests/test_compare.py::test_a_corpus_archive_becomes_train_and_validation_files",
    ),
    "muloco.generate": (
        f"{THIS}::test_entry_point_help[muloco.generate]",
        f"{THIS}::test_local_job_script[diffusion.sh]",
        "tests/test_diffusion.py::test_generate_fills_every_mask_after_the_prompt_and_repeats_with_a_seed",
    ),
    "muloco.launch.lighthouse": (
        f"{THIS}::test_entry_point_help[muloco.launch.lighthouse]",
        "tests/test_launch.py::test_lighthouse_cli_prints_url_line_and_stops_on_sigterm",
        SLURM_ARRAY,
    ),
    "muloco.launch.netns": (
        f"{THIS}::test_entry_point_help[muloco.launch.netns]",
        "tests/test_netns.py::test_the_drill_command_cuts_and_restores_a_recorded_testbed",
    ),
    "muloco.export": (
        f"{THIS}::test_entry_point_help[muloco.export]",
        "tests/test_export.py::test_an_ar_run_loads_in_transformers_with_muloco_logits_and_tokens",
    ),
    "muloco.evaluate": (
        f"{THIS}::test_entry_point_help[muloco.evaluate]",
        "tests/test_evaluate.py::test_an_ar_run_scores_as_by_hand_and_its_export_scores_the_same",
    ),
    "muloco.launch.lighthouse_relay": (
        f"{THIS}::test_entry_point_help[muloco.launch.lighthouse_relay]",
        "tests/test_lighthouse_relay.py::test_the_relay_process_prints_its_url_ignores_sigterm_and_dies_with_its_parent",
        "tests/test_slurm_jobs.py::test_array_layout_groups_follow_a_requeued_lighthouse_to_its_new_address_and_lose_nothing",
    ),
    "muloco.launch.local": (
        f"{THIS}::test_entry_point_help[muloco.launch.local]",
        f"{THIS}::test_local_job_script[muloco.sh]",
        "tests/test_diloco.py::test_sharded_replicas_compress_their_shards_and_resume",
    ),
    "muloco.launch.rank_process": (
        f"{THIS}::test_entry_point_help[muloco.launch.rank_process]",
        "tests/test_launch.py::test_rank_process_ends_as_its_rank_ended",
    ),
    "muloco.launch.replica_group": (
        f"{THIS}::test_entry_point_help[muloco.launch.replica_group]",
        f"{THIS}::test_local_job_script[muloco.sh]",
    ),
    "muloco.launch.slurm": (
        f"{THIS}::test_entry_point_help[muloco.launch.slurm]",
        f"{THIS}::test_slurm_script_dry_run[submit.sh]",
        "tests/test_slurm_jobs.py::test_k2_muloco_2bit_job_runs_to_completion_under_slurm",
    ),
    "muloco.launch.slurm.group": (f"{THIS}::test_entry_point_help[muloco.launch.slurm.group]", SLURM_ARRAY),
    "muloco.launch.slurm_group": (f"{THIS}::test_entry_point_help[muloco.launch.slurm_group]",),
    "muloco.model_map": (
        f"{THIS}::test_entry_point_help[muloco.model_map]",
        "tests/test_model_map.py::test_the_table_as_users_print_it",
    ),
    "muloco.report": (
        f"{THIS}::test_entry_point_help[muloco.report]",
        "tests/test_report.py::test_table_rows_match_each_runs_summary",
    ),
    "muloco.train": (
        f"{THIS}::test_entry_point_help[muloco.train]",
        "tests/test_training.py::test_loss_falls_on_embedded_corpus",
    ),
    # top-level executables
    "torchft_lighthouse": f"{THIS}::test_torchft_lighthouse_script_serves_and_stops",
    "setup.sh": ".ci/run",  # CI runs it before the tests
    # benchmarks (their own smoke test)
    "bench/block_sampler.py": f"{BENCH_TEST}[block_sampler.py]",
    "bench/codecs.py": f"{BENCH_TEST}[codecs.py]",
    "bench/conversion.py": f"{BENCH_TEST}[conversion.py]",
    "bench/diffusion.py": f"{BENCH_TEST}[diffusion.py]",
    "bench/exchange_memory.py": f"{BENCH_TEST}[exchange_memory.py]",
    "bench/generate.py": f"{BENCH_TEST}[generate.py]",
    "bench/gpu_suite.py": f"{BENCH_TEST}[gpu_suite.py]",
    "bench/gpu_throughput.py": f"{BENCH_TEST}[gpu_throughput.py]",
    "bench/link_planner.py": f"{BENCH_TEST}[link_planner.py]",
    "bench/live_bytes.py": f"{BENCH_TEST}[live_bytes.py]",
    "bench/local_run.py": f"{BENCH_TEST}[local_run.py]",
    "bench/machine.py": f"{BENCH_TEST}[machine.py]",
    "bench/muon.py": f"{BENCH_TEST}[muon.py]",
    "bench/round_modes.py": f"{BENCH_TEST}[round_modes.py]",
    "bench/startup.py": f"{BENCH_TEST}[startup.py]",
    "bench/sync_overhead.py": f"{BENCH_TEST}[sync_overhead.py]",
    "bench/partition_drills.py": f"{BENCH_TEST}[partition_drills.py]",
    "bench/trainer_overhead.py": f"{BENCH_TEST}[trainer_overhead.py]",
    "bench/unequal_groups.py": f"{BENCH_TEST}[unequal_groups.py]",
}


def user_runnable() -> set[str]:
    """Everything a user can run, found on disk (the table's keys must be exactly these)."""

    def public(paths):
        return {p.relative_to(REPO).as_posix() for p in paths if p.is_file() and not p.name.startswith("_")}

    found = public((REPO / "jobs").rglob("*.sh"))
    found |= public((REPO / "jobs" / "sweeps").glob("*.py"))
    found |= public((REPO / "config").rglob("*.py"))
    found |= public((REPO / "bench").glob("*.py"))
    found |= {p.name for p in REPO.iterdir() if p.is_file() and os.access(p, os.X_OK)}
    found |= set(ENTRY_POINTS)
    return found


def test_everything_user_runnable_is_in_the_coverage_table():
    found = user_runnable()
    missing = sorted(found - COVERAGE.keys())
    stale = sorted(COVERAGE.keys() - found)
    assert not missing, (
        f"user-runnable, but no test in tests/test_smoke.py's COVERAGE runs it (add a smoke test and a row): {missing}"
    )
    assert not stale, f"COVERAGE rows for things that no longer exist: {stale}"


def _named_tests() -> list[tuple[str, str]]:
    return [
        (thing, node) for thing, nodes in COVERAGE.items() for node in ((nodes,) if isinstance(nodes, str) else nodes)
    ]


def test_every_test_the_table_names_exists():
    wrong = []
    for thing, node in _named_tests():
        file, _, name = node.partition("::")
        path = REPO / file
        if not name:  # a file that runs it (CI's script)
            if not path.is_file() or thing not in path.read_text():
                wrong.append(f"{thing}: {file} does not run it")
            continue
        func, _, param = name.partition("[")
        if not path.is_file():
            wrong.append(f"{thing}: {file} does not exist")
        elif not re.search(rf"^def {re.escape(func)}\(", path.read_text(), re.M):
            wrong.append(f"{thing}: {file} has no test {func}")
        elif file == THIS and param and param[:-1] not in PARAMS.get(func, []):
            wrong.append(f"{thing}: {func} has no parameter {param[:-1]!r}")
    assert not wrong, "\n".join(wrong)


# -- background runs -----------------------------------------------------------------------------


@dataclass
class Ran:
    rc: int | None  # None: killed at its timeout
    out: str  # stdout and stderr together
    cwd: Path
    argv: list[str] | None = None  # for a recorded job script: the command line it ran


class Background:
    """Runs started at once and run two at a time; each is a subprocess in a session of its own,
    with a timeout. ``close`` kills what still runs (by PID: the session's process group) and
    starts nothing more."""

    def __init__(self, workers: int = 2):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="smoke")
        self.futures: dict[str, Future] = {}
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.closing = False
        self.recorded: dict[str, Ran] = {}  # job script -> the command line it ran (see RECORDER)
        self._replayed: dict[str, dict] = {}  # the modules driver's results by key, once read

    def submit(self, key: str, cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> None:
        # the environment is taken now: tests change os.environ (monkeypatch) while these start
        self.futures[key] = self.pool.submit(self.run, cmd, cwd, timeout, env or clean_env())

    def result(self, key: str) -> Ran:
        assert key in self.futures, f"{key} was not started (deselected when the module started?)"
        return self.futures[key].result()  # bounded: every run has its own timeout

    def replayed(self, key: str) -> dict:
        """One item of the ``modules`` driver: {"key", "code", "out", "cwd"}."""
        ran = self.result("modules")
        if not self._replayed:
            items = (json.loads(line[len(RESULT) :]) for line in ran.out.splitlines() if line.startswith(RESULT))
            self._replayed = {item["key"]: item for item in items}
        assert key in self._replayed, f"the modules driver ended ({ran.rc}) before {key}:\n{_tail(ran.out)}"
        return self._replayed[key]

    def run(self, cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> Ran:
        with self.lock:
            if self.closing:
                return Ran(None, "not started: the module ended", cwd)
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.live.add(proc)
        try:
            followed = Watched(proc, timeout)  # timeout: seconds without a new line of output
            done = followed.finished()
            if not done:
                _kill_session(proc)
            out = followed.result().stdout
            rc = proc.returncode if done else None
            out += "" if done else f"\n[killed: nothing printed for {timeout} s]"
        finally:
            with self.lock:
                self.live.discard(proc)
        return Ran(rc, out, cwd)

    def close(self) -> None:
        with self.lock:
            self.closing = True
            for proc in list(self.live):
                _kill_session(proc)
        self.pool.shutdown(wait=True, cancel_futures=True)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a process we started in a session of its own, while that
    process is not yet reaped (so its pid, the group's id, cannot be anyone else's)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what a surrounding job, SLURM allocation or test would leak into
    a user's run; unbuffered, one thread per process (two runs share 2 cores)."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHFT_LIGHTHOUSE",
        "CUDA_VISIBLE_DEVICES",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "MULOCO_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


FAKE_SINFO = """#!/bin/sh
# a GPU cluster for dry runs: partition gpu (the default), 8 nodes of 64 CPUs and 8 GPUs
case " $* " in
  *" -N "*) for i in 1 2 3 4 5 6 7 8; do echo "gpu*|node$i|64|gpu:h100:8|1000000|idle|2-00:00:00"; done ;;
  *) echo "gpu*" ;;
esac
"""


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory) -> dict[str, str]:
    """Environment entries for a dry run placed on a fake GPU cluster, never this machine's
    SLURM nor the user's ~/.config/muloco/cluster.toml."""
    root = tmp_path_factory.mktemp("fake-slurm")
    sinfo = root / "bin" / "sinfo"
    sinfo.parent.mkdir()
    sinfo.write_text(FAKE_SINFO)
    sinfo.chmod(0o755)
    return {
        "PATH": f"{sinfo.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MULOCO_CLUSTER_FILE": str(root / "no-cluster.toml"),
    }


def _record(script: Path, args: list[str], folder: Path, env: dict[str, str]) -> Ran:
    """Run a job script with RECORDER as its Python; ``argv``: the command line it ran."""
    proc, argv = recorded_python([str(script), *args], clean_env(**env), folder, cwd=folder)
    return Ran(proc.returncode, proc.stdout + proc.stderr, folder, argv or [])


TINY_RUN = [*TINY, "--training.steps", "2", "--outer.sync_every", "1", "--metrics.log_freq", "1"]
SLURM_OVERRIDES = ["--training.steps", "60"]  # a multiple of every config's sync interval


def _selected(request) -> set[str]:
    here = Path(__file__).resolve()
    return {item.name for item in request.session.items if Path(str(item.path)).resolve() == here}


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory, fake_cluster):
    """Start every selected expensive run now (the quick dry runs first: their tests come first,
    after the in-process ones); tests collect their results.

    The SLURM wrappers and the 8-GPU node script run right here with RECORDER as their Python;
    what they would run (``python -m muloco.launch.slurm|local ... --dry-run``) runs for real
    in the ``modules`` driver, one process for all of them and every ``--help``. submit.sh,
    which every wrapper ends in, runs as it is, with the checkout's Python."""
    selected = _selected(request)
    bg = Background()
    modules: list[dict] = []
    try:
        for script, (kind, config, extra, _) in SLURM_SCRIPTS.items():
            if f"test_slurm_script_dry_run[{script}]" not in selected:
                continue
            folder = tmp_path_factory.mktemp(f"slurm-{script}")
            args = [
                *([kind, "--config", config] if script == "submit.sh" else []),
                *extra,
                "--dry-run",
                "--",
                *SLURM_OVERRIDES,
            ]
            if script == "submit.sh":
                bg.submit(
                    f"slurm/{script}",
                    [str(REPO / "jobs" / "slurm" / script), *args],
                    folder,
                    120,
                    clean_env(**fake_cluster),
                )
                continue
            bg.recorded[script] = _record(REPO / "jobs" / "slurm" / script, args, folder, fake_cluster)
            argv = bg.recorded[script].argv
            if argv[:2] == ["-m", "muloco.launch.slurm"]:
                cwd = folder / "cwd"
                cwd.mkdir()
                modules.append(
                    {
                        "key": f"slurm:{script}",
                        "module": argv[1],
                        "argv": argv[2:],
                        "cwd": str(cwd),
                        "env": fake_cluster,
                    }
                )
        if "test_eight_gpu_node_script_dry_run" in selected:
            folder = tmp_path_factory.mktemp("8workers")
            script = REPO / "jobs" / "diloco" / "8workers_x1gpu.sh"
            bg.recorded["8workers"] = _record(script, ["--dry-run"], folder, {})
            argv = bg.recorded["8workers"].argv
            if argv[:2] == ["-m", "muloco.launch.local"]:
                cwd = folder / "cwd"
                cwd.mkdir()
                modules.append(
                    {
                        "key": "8workers",
                        "module": argv[1],
                        "argv": argv[2:],
                        "cwd": str(cwd),
                        "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
                    }
                )
        modules += [
            {"key": f"help:{m}", "module": m, "argv": HELP_ARGS.get(m, ["--help"]), "cwd": str(REPO), "env": {}}
            for m in ENTRY_POINTS
            if f"test_entry_point_help[{m}]" in selected
        ]
        if modules:
            spec = tmp_path_factory.mktemp("modules") / "spec.json"
            spec.write_text(json.dumps(modules))
            bg.submit("modules", [sys.executable, __file__, "modules", str(spec)], spec.parent, 300)
        configs = [c for c in CONFIGS_TRAINED_HERE if f"test_config_trains[{c}]" in selected]
        if configs:
            root = tmp_path_factory.mktemp("configs")
            bg.submit("configs", [sys.executable, __file__, "train", str(root), *configs], root, 600)
        for script in LOCAL_SCRIPTS:
            if f"test_local_job_script[{script}]" in selected:
                dump = tmp_path_factory.mktemp(f"local-{script}") / "run"
                extra = (
                    ["--validator.no-enable"]
                    if script == "diffusion.sh"
                    else ["--checkpoint.no-enable", "--validator.freq", "1000"]
                )
                cmd = [
                    str(REPO / "jobs" / "local" / script),
                    "--replicas",
                    "1",
                    "--threads",
                    "1",
                    "--",
                    *TINY_RUN,
                    *extra,
                    "--dump_folder",
                    str(dump),
                ]
                bg.submit(f"local/{script}", cmd, dump.parent, 300)
        yield bg
    finally:
        bg.close()


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


# -- sweeps (in this process, while the background runs) -----------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_dry_run(name, tmp_path, monkeypatch, capsys, fake_cluster):
    """``python jobs/sweeps/NAME.py --dry-run`` (the file as __main__, in this process): every run
    planned and placed on the fake GPU cluster, its sbatch script(s) printed, nothing written."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MULOCO_"))]:
        monkeypatch.delenv(key)
    for key, value in fake_cluster.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    path = REPO / "jobs" / "sweeps" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--dry-run"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    out, err = capsys.readouterr()
    assert done.value.code == 0, out[-2000:] + err[-3000:]
    assert "warning" not in err, err
    runs = runpy.run_path(str(path))["SWEEP"].runs
    assert f"dry run: {len(runs)} run(s); nothing written, nothing submitted" in out
    planned = re.findall(r"^run (\S+): (\w+) --config (\S+) -- ", out, re.M)
    assert [(kind, config) for _, kind, config in planned] == [(r.kind, r.config) for r in runs]
    assert len({n for n, _, _ in planned}) == len(runs), "run names are unique"
    assert '#SBATCH --partition="gpu"' in out
    assert not list(tmp_path.iterdir()), "a dry run wrote files"


# -- the lighthouse script -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_torchft_lighthouse_script_serves_and_stops(tmp_path):
    """./torchft_lighthouse prints its URL, serves its status page and stops on SIGTERM."""
    proc = subprocess.Popen(
        [str(REPO / "torchft_lighthouse"), "--replicas", "1", "--bind", "127.0.0.1:0"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()  # the first line: its URL (blocks until printed)
        m = re.fullmatch(r"lighthouse listening on (http://127\.0\.0\.1:\d+) \(status page: \1/\)\n", line)
        assert m, line
        with urllib.request.urlopen(m.group(1) + "/status", timeout=120) as r:
            assert r.status == 200 and b"quorum" in r.read().lower()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=240) == 0
    finally:
        _kill_session(proc)
        proc.wait(timeout=240)
        proc.stdout.close()


# -- dry runs and --help (the modules driver) ----------------------------------------------------


def _recorded(runs, key: str, want: list[str]) -> None:
    ran = runs.recorded[key]
    assert ran.rc == 0, ran.out
    assert ran.argv == want, f"the script ran python {ran.argv}"


@pytest.mark.timeout(300)
def test_eight_gpu_node_script_dry_run(runs):
    """jobs/diloco/8workers_x1gpu.sh (through workers.sh) on an 8-GPU node
    (CUDA_VISIBLE_DEVICES=0..7): one GPU per worker, the GPU preset, a majority quorum; the dry
    run starts and writes nothing."""
    _recorded(
        runs,
        "8workers",
        [
            "-m",
            "muloco.launch.local",
            "--config",
            "gpu/muloco_2bit",
            "--replicas",
            "2",
            "--replicas",
            "8",
            "--gpus-per-replica",
            "1",
            "--dry-run",
        ],
    )
    r = runs.replayed("8workers")
    assert r["code"] == 0, _tail(r["out"])
    out = r["out"]
    assert "dry run: 8 replica group(s) x 1 rank(s), 1 GPU(s) per group" in out and "nothing is started" in out
    assert "[lh] torchft lighthouse in the launcher's process: bind 127.0.0.1:0, min_replicas 5," in out
    for i in range(8):
        assert f"[r{i}] CUDA_VISIBLE_DEVICES={i} " in out
        assert (
            f"-m muloco.train --config gpu/muloco_2bit --fault_tolerance.replica_id {i} --fault_tolerance.group_size 8"
        ) in out
    assert not list(Path(r["cwd"]).iterdir()), "a dry run wrote files"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", list(SLURM_SCRIPTS))
def test_slurm_script_dry_run(runs, script):
    """The script with --dry-run and a trainer override: the sbatch script(s) its kind makes for
    its config, placed on the fake GPU cluster, written and submitted nowhere."""
    kind, config, extra, modules = SLURM_SCRIPTS[script]
    if script == "submit.sh":
        ran = runs.result(f"slurm/{script}")
        code, out, cwd = ran.rc, ran.out, ran.cwd
    else:
        _recorded(
            runs,
            script,
            ["-m", "muloco.launch.slurm", kind, "--config", config, *extra, "--dry-run", "--", *SLURM_OVERRIDES],
        )
        r = runs.replayed(f"slurm:{script}")
        code, out, cwd = r["code"], r["out"], Path(r["cwd"])
    assert code == 0, _tail(out)
    assert "warning" not in out, "the dry run was not checked against the (fake) cluster"
    headers = re.findall(r"^# ===== (\S+) \(dry run: not written, not submitted\) =====$", out, re.M)
    assert headers, _tail(out)
    assert out.count("#!/bin/bash") == len(headers) == out.count('#SBATCH --partition="gpu"\n')
    assert f"\nCONFIG={config}\n" in out and f"OVERRIDES=({' '.join(SLURM_OVERRIDES)})" in out, _tail(out)
    for module in modules:
        assert f" -m {module} " in out, f"{module} not in\n{_tail(out)}"
    assert not list(cwd.iterdir()), "a dry run wrote files"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_help(runs, module):
    """``python -m MODULE --help`` exits 0 with its usage (run as __main__, all in one process)."""
    h = runs.replayed(f"help:{module}")
    if module in HELP_ARGS:  # no --help: its usage when given nothing
        assert h["code"] == 1 and h["out"].startswith(f"usage: python -m {module} "), h
        return
    assert h["code"] == 0, h["out"][-3000:]
    assert h["out"].startswith("usage: ") and "-h, --help" in h["out"], h["out"][:2000]


# -- job scripts ---------------------------------------------------------------------------------


@pytest.mark.timeout(400)
@pytest.mark.parametrize("script", list(LOCAL_SCRIPTS))
def test_local_job_script(runs, script):
    """The script itself with one replica group (K=2 through the same launcher: test_diloco.py),
    its own default config, the lighthouse it starts, 2 steps with a sync after each."""
    ran = runs.result(f"local/{script}")
    config, objective = LOCAL_SCRIPTS[script]
    assert ran.rc == 0, _tail(ran.out)
    assert "local job finished: 1 replicas ok" in ran.out and "local job: lighthouse http://127.0.0.1:" in ran.out
    assert f"[r0] run summary ({objective} objective)" in ran.out, _tail(ran.out)
    run = ran.cwd / "run" / "replica_0"
    s = _summary(run)
    assert s["steps"] == 2 and s["objective"] == objective and math.isfinite(s["final_train_loss"])
    assert s["diloco"]["syncs_committed"] == s["diloco"]["syncs"] == 2
    assert json.loads((run / "run.json").read_text())["config"] == str(REPO / "config" / f"{config}.py")
    assert (ran.cwd / "run" / "logs" / "replica_0.log").is_file()
    if script == "diffusion.sh":  # then two samples from θ_g of the run's last checkpoint
        assert f"samples from θ_g of {ran.cwd / 'run'}:" in ran.out
        for prompt in ("def ", "import "):
            assert f"--- mdlm sample, step 2 (θ_g), prompt {prompt!r}" in ran.out, _tail(ran.out)


# -- configs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(runs) -> tuple[Ran, dict[str, dict]]:
    """The config driver's run and, per config it finished, its result line."""
    ran = runs.result("configs")
    done = {}
    for line in ran.out.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT) :])
            done[result["config"]] = result
    return ran, done


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGS_TRAINED_HERE)
def test_config_trains(trained, name):
    """The config loads and trains a few steps on CPU with the tiny override (a GPU preset too:
    fp32 and no compile there), as one replica group with its own lighthouse if it has an
    outer loop."""
    ran, done = trained
    assert name in done, f"the config driver ended ({ran.rc}) before {name} finished:\n{_tail(ran.out)}"
    result = done[name]
    section = ran.out.split(f"{BEGIN}{name}\n", 1)[1].split(f"{RESULT}", 1)[0]
    assert result["exit"] == 0, _tail(section)
    steps, syncs = (3, 1) if name in STREAMING else (2, 2)
    objective = "mdlm" if name.startswith("diffusion/") else "ar"
    assert f"run summary ({objective} objective)" in section, _tail(section)
    folder = Path(result["run_folder"])
    s = _summary(folder)
    assert s["steps"] == steps and s["precision"] == "float32" and math.isfinite(s["final_train_loss"])
    assert json.loads((folder / "run.json").read_text())["config"] == str(REPO / "config" / f"{name}.py")
    assert s["objective"] == objective
    if name == "diffusion/sft":
        assert "training.epochs 0.1: 2 steps (" in section and "metrics.log_freq 0.5 of 2 steps: every 1" in section
    if result["outer"]:
        assert s["diloco"]["syncs_committed"] == s["diloco"]["syncs"] == syncs


# -- drivers: `python tests/test_smoke.py train ROOT CONFIG...` / `... modules SPEC.json` -----------

BEGIN, RESULT = "SMOKE-BEGIN ", "SMOKE-RESULT "


def _train_configs(root: Path, names: list[str]) -> None:
    """Each config in turn in this process: the trainer's own ``main`` (what ``python -m
    muloco.train`` runs), a fresh rendezvous port each, and for a config with an outer loop a
    lighthouse of its own (in this process) and one replica group. One result line each."""
    import traceback

    from muloco import compat

    compat.apply()
    from muloco import train
    from muloco.components.checkpoint import run_folder
    from muloco.config.cli import parse_args
    from muloco.launch.lighthouse import start_lighthouse
    from muloco.utils.ports import free_port

    sft = root / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."}) + "\n" for i in range(64)
        )
    )
    for name in names:
        print(f"{BEGIN}{name}", flush=True)
        args = [
            "--config",
            name,
            *TINY,
            "--training.steps",
            "3" if name in STREAMING else "2",
            "--metrics.log_freq",
            "1",
            "--checkpoint.no-enable",
            "--validator.no-enable",
            "--training.global_batch_size",
            "-1",
            "--compile.no-enable",  # a GPU preset's, on CPU
            "--dump_folder",
            str(root / name.replace("/", "-")),
        ]
        if name == "diffusion/sft":  # and Transformer Lab's controls: the length in epochs (0.1 of about 61
            # rows at 4 a step: 2 steps), the log interval as a fraction of the run, Dream's per-batch cut
            at = args.index("--training.steps")
            args[at : at + 2] = ["--training.epochs", "0.1"]
            args[args.index("--metrics.log_freq") + 1] = "0.5"
            args += ["--dataloader.source.dataset_path", str(sft), "--dataloader.source.per_batch_cutoff"]
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        lighthouse, outer, code, folder = None, False, None, ""
        try:
            outer = hasattr(parse_args(["--config", name])[1], "outer")
            if outer:
                args += [
                    "--outer.sync_every",
                    "9" if name in STREAMING else "1",
                    "--fault_tolerance.replica_id",
                    "0",
                    "--fault_tolerance.group_size",
                    "1",
                ]
                lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=1)
                os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.url
            folder = str(run_folder(parse_args(args)[1]))
            code = train.main(args)
        except Exception:
            traceback.print_exc()
        finally:
            if lighthouse is not None:
                lighthouse.shutdown()
            os.environ.pop("TORCHFT_LIGHTHOUSE", None)
        print(RESULT + json.dumps({"config": name, "exit": code, "outer": outer, "run_folder": folder}), flush=True)


def _run_modules(spec: Path) -> None:
    """Each item of ``spec`` ({key, module, argv, cwd, env}) in turn in this process: the module
    run as __main__ (``python -m MODULE ARGV...``) in ``cwd`` with ``env`` added; one result
    line each: its exit status (``sys.exit("message")``: 1, the message printed) and output."""
    import traceback
    import warnings

    warnings.simplefilter("ignore")  # runpy: a module an earlier one imported
    for item in json.loads(spec.read_text()):
        out, code = io.StringIO(), 0
        saved = dict(os.environ)
        os.environ.update(item["env"])
        os.chdir(item["cwd"])
        sys.argv = [item["module"], *item["argv"]]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                runpy.run_module(item["module"], run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code
            except Exception:  # a crash is this item's result, not the end of the others
                traceback.print_exc()
                code = "crashed"
        os.environ.clear()
        os.environ.update(saved)
        if isinstance(code, str):
            out.write(code + "\n")
            code = 1
        print(
            RESULT + json.dumps({"key": item["key"], "code": code or 0, "out": out.getvalue(), "cwd": item["cwd"]}),
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1] == "train":
        _train_configs(Path(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "modules":
        _run_modules(Path(sys.argv[2]))
    else:
        sys.exit(f"unknown driver {sys.argv[1]!r}")
