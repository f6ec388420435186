"""Shared helpers: run the real entry point in a child process, watched for progress.

A child process counts as hung when it prints nothing for ``QUIET_S`` seconds, never when its total
time passes a cap: a loaded machine makes every line come later, a hang makes them stop."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    # One thread per process, set before torch is first imported, and inherited by every process a
    # test starts: each xdist worker and each run it starts then has its share of the cores instead
    # of all of them. The suite's tiny models gain nothing from more, and on a busy 2-core machine
    # torch's threads of two workers and their runs oversubscribe the cores: one in-process training
    # test took 37 s of CPU with 2 threads and 7 s with 1, beside one other job. A value given in
    # the environment is kept.
    os.environ.setdefault(_var, "1")

if "MULOCO_CACHE_DIR" not in os.environ:
    # The JSONL line indexes the suite's runs build (``muloco/data/line_index.py``) go to a folder
    # of this process's own, inherited by the runs it starts and removed at its exit: nothing is
    # left in the user's cache, and no test finds an index an earlier run built.
    import atexit
    import shutil
    import tempfile

    os.environ["MULOCO_CACHE_DIR"] = tempfile.mkdtemp(prefix="muloco-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MULOCO_CACHE_DIR"], True)

# Small enough that a run of tens of steps takes seconds on a 2-core CPU.
TINY = [
    "--model.flavor",
    "llama3-w64-d2-h2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--validator.steps",
    "2",
]


def tiny_model(causal: bool, vocab: int = 32, seed: int = 0):
    """An initialised ``llama3-w64-d2-h2`` on CPU with exactly ``vocab`` embedding rows, in eval
    mode, built as torchtitan's trainer builds it (meta device, to_empty, init_weights)."""
    import torch

    from muloco import compat

    compat.apply()
    from muloco.models import ModelConfig, init_model

    torch.manual_seed(seed)
    return init_model(ModelConfig(flavor="llama3-w64-d2-h2", vocab_multiple_of=1), vocab, causal).eval()


QUIET_S = 240
"""Seconds without a new line of output after which a child process is hung (importing torch
and torchtitan prints nothing for up to a minute on a busy core)."""


class Watched:
    """A child process in its own session whose stdout and stderr are read line by line as they
    come; ``hung()`` says when nothing new came for ``quiet_s`` seconds."""

    def __init__(self, proc: subprocess.Popen, quiet_s: float):
        """Follow ``proc`` (started with text pipes; stderr may be merged into stdout)."""
        self.proc, self.cmd, self.quiet_s = proc, proc.args, quiet_s
        self.out: list[str] = []
        self.err: list[str] = []
        self.last = time.monotonic()
        self.readers = [
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
            for stream, sink in ((proc.stdout, self.out), (proc.stderr, self.err))
            if stream is not None
        ]
        for reader in self.readers:
            reader.start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            self.last = time.monotonic()

    @classmethod
    def start(cls, cmd: list[str], env: dict, quiet_s: float, cwd: Path = REPO) -> "Watched":
        return cls(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            ),
            quiet_s,
        )

    def hung(self) -> bool:
        return self.proc.poll() is None and time.monotonic() - self.last > self.quiet_s

    def finished(self) -> bool:
        """Wait until the process exits (True) or prints nothing for ``quiet_s`` s (False: hung,
        left running for the caller to stop)."""
        while self.proc.poll() is None:
            if self.hung():
                return False
            time.sleep(0.1)
        return True

    def kill(self) -> None:
        """The process and whatever it started (its session), by its PID."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def result(self) -> subprocess.CompletedProcess:
        for reader in self.readers:
            reader.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, "".join(self.out), "".join(self.err))

    def hang_report(self) -> str:
        tail = "".join((self.out + self.err)[-40:])
        return f"{' '.join(map(str, self.cmd[:6]))} ... printed nothing for {self.quiet_s:g} s (hung):\n{tail}"


def watch(commands: list[list[str]], envs: list[dict], quiet_s: float = QUIET_S) -> list[subprocess.CompletedProcess]:
    """Start every command at once and wait for all of them; one that prints nothing for
    ``quiet_s`` seconds fails the test, and every process still running is killed by its PID."""
    procs: list[Watched] = []
    try:
        for cmd, env in zip(commands, envs):
            procs.append(Watched.start(cmd, env, quiet_s))
        while any(w.proc.poll() is None for w in procs):
            hung = next((w for w in procs if w.hung()), None)
            assert hung is None, hung.hang_report()
            time.sleep(0.1)
    finally:
        for w in procs:
            w.kill()
    return [w.result() for w in procs]


def run_watched(
    cmd: list, *, cwd: Path | str = REPO, env: dict | None = None, check: bool = False, quiet_s: float = QUIET_S
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` watched for progress instead of
    capped in total time: the process fails the test when it prints nothing for ``quiet_s``
    seconds (then it and what it started are killed by its PID), never for being slow."""
    watched = Watched.start([str(c) for c in cmd], env if env is not None else dict(os.environ), quiet_s, Path(cwd))
    try:
        assert watched.finished(), watched.hang_report()
    finally:
        watched.kill()
    done = watched.result()
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done


def run_train(args: list[str], quiet_s: float = QUIET_S, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m muloco.train` as users do, watched for progress (``QUIET_S``)."""
    cmd = [sys.executable, "-m", "muloco.train", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return watch([cmd], [full_env], quiet_s)[0]


def run_together(commands: list[list[str]], envs: list[dict], quiet_s: float = QUIET_S) -> list[tuple[int, str]]:
    """Start every command at once (they meet in collectives) and wait for all of them:
    (exit code, its stdout then its stderr) each. The two are read apart, so a line a process
    prints to stdout is never cut by what its other threads (gloo, warnings) write to stderr."""
    done = watch(
        commands, [{**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env} for env in envs], quiet_s
    )
    return [(p.returncode, p.stdout + p.stderr) for p in done]


def run_gloo_ranks(script: Path, world: int, args: list[str], quiet_s: float = QUIET_S) -> list[tuple[int, str]]:
    """``script`` as ranks 0..world-1 of one torch.distributed job (env:// rendezvous on 127.0.0.1)."""
    from muloco.utils.ports import free_port

    port = str(free_port())
    envs = [
        {
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for r in range(world)
    ]
    return run_together([[sys.executable, str(script), *args]] * world, envs, quiet_s)


def read_metrics(folder: Path) -> list[dict]:
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}


SLURM_MODULES = {"test_slurm_cluster.py", "test_slurm_jobs.py", "test_slurm_scripts.py"}
"""The modules whose tests share the session's one local SLURM (the ``slurm`` fixture)."""
LONG_FIRST = [
    "test_slurm_jobs.py",
    "test_slurm_cluster.py",
    "test_diloco.py",
    "test_diffusion.py",
    "test_export.py",
    "test_compare.py",
    "test_training.py",
    "test_smoke.py",
    "test_bench_smoke.py",
    "test_fault_drills.py",
    "test_convert_job.py",
    "test_slurm_multinode.py",
    "test_hf_families.py",
    "test_sweep_local.py",
    "test_recipes.py",
    "test_lora_training.py",
    "test_compressed_exchange.py",
    "test_evaluate.py",
    "test_import.py",
    "test_preemption.py",
    "test_report.py",
    "test_muon.py",
    "test_compress.py",
    "test_launch_orphans.py",
    "test_launch_dump_lock.py",
    "test_launch.py",
    "test_partition_drills.py",
    "test_netns.py",
]
"""Modules that take longest start first, so the workers finish together (the rest follow in
their usual order). Only an order: a module missing here just starts later."""


QUICK = {
    "compare": {
        "test_compare.py": (
            "test_plan_overrides_and_bad_choices",
            "test_every_row_validates_and_tunes_on_the_same_held_out_rows",
            "test_one_seed_verdicts_say_so_and_a_margin_inside_one_percent_is_a_tie",
            "test_the_table_says_how_it_was_made_and_what_each_gap_is_against",
            "test_verdicts_call_a_margin_inside_the_spread_a_tie",
            "test_tune_chooses_on_the_seeds_every_point_ran",
            "test_time_left_counts_only_the_steps_trained_since_a_resume",
        )
    },
    "compat": {"test_compat.py": ()},
    "components": {"test_device_defaults.py": ()},
    "compress": {"test_compress.py": ()},
    "config": {"test_config.py": ()},
    "data": {"test_data.py": (), "test_tokenizer.py": ()},
    "evaluate": {"test_evaluate.py": ("test_a_bad_option_or_an_unwritable_out_is_refused_before_anything_loads",)},
    "hf": {"test_hf_families.py": ("test_the_adapter_maps_each_family_there_and_back_bit_for_bit",)},
    "launch": {"test_gpu_slices.py": (), "test_slurm_scripts.py": ()},
    "models": {"test_models.py": (), "test_lora.py": ()},
    "objectives": {
        "test_objectives.py": (),
        "test_sft_controls.py": (),
        "test_diffusion.py": (
            "test_transfer_schedule_and_bad_sampling_settings",
            "test_diffusion_sampler_keeps_the_prompt_leaves_no_mask_and_is_deterministic",
            "test_autoregressive_sampler_stops_at_eos_and_repeats_with_a_seed",
        ),
    },
    "optim": {
        "test_muon.py": (
            "test_update_matches_float64_reference",
            "test_newton_schulz_singular_values_in_band",
            "test_bad_settings_are_clear_errors",
            "test_vectors_are_refused",
        )
    },
    "outer": {"test_outer.py": (), "test_rounds.py": (), "test_link.py": ()},
    "runs": {"test_lives.py": (), "test_run_facts.py": ()},
    "sizing": {"test_model_map.py": ()},
    "report": {
        "test_report.py": (
            "test_the_report_imports_no_torch_and_no_tyro",
            "test_times_of_a_run_over_an_emulated_link_say_so",
            "test_deadline_rounds_are_counted_on_each_group_s_current_timeline",
        )
    },
    "export": {"test_export.py": ("test_what_this_export_cannot_write_yet_is_named",)},
    "generate": {
        "test_diffusion.py": (
            "test_generate_refuses_diffusion_options_on_an_autoregressive_run",
            "test_generate_names_a_folder_that_is_not_a_run",
        )
    },
    "utils": {
        "test_created_dirs.py": (),
        "test_errors.py": (),
        "test_commands.py": (),
        "test_docs.py": (),
        "test_quick_tier.py": (),
    },
}
"""The quick tier (``pytest -m quick``: a change's first signal in about two minutes on two cores):
per package folder of ``muloco/``, the test modules (all their tests: ``()``) or the tests by name
that exercise it without training a model for long. ``tests/test_quick_tier.py`` checks every
folder has an entry and every named test exists."""


def is_quick(item) -> bool:
    for modules in QUICK.values():
        names = modules.get(item.path.name)
        if names is not None and (not names or item.name.split("[")[0] in names):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:  # -m 'not slurm': a machine where the suite must not install or start SLURM
        if item.path.name in SLURM_MODULES | {"test_slurm_multinode.py"}:
            item.add_marker(pytest.mark.slurm)
        if is_quick(item):
            item.add_marker(pytest.mark.quick)


@functools.cache
def _has_module_fixture(module: str) -> bool:
    """Whether a test module defines a fixture its tests share (``scope="module"``)."""
    return re.search(r"""scope\s*=\s*["']module["']""", (REPO / module).read_text()) is not None


def pytest_xdist_make_scheduler(config, log):
    """The suite runs on pytest-xdist workers (``-n``, pyproject's addopts). The tests of a module
    with a module fixture stay on one worker, so the fixture starts its runs once; the SLURM
    modules share one worker, so the session's one local SLURM is started once; every other test
    goes to whichever worker is free (a module of long tests does not hold up the end). In
    collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithSlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if Path(module).name in SLURM_MODULES:
                return "slurm"
            return module if _has_module_fixture(module) else nodeid

    config.option.loadscopereorder = False  # keep LONG_FIRST's order
    return ModulesWithSlurmTogether(config, log)


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """One real local SLURM (munged + slurmctld + slurmd) for the whole run, its SLURM_CONF and
    PATH (with the sacct substitute) exported so that submitit and plain sbatch find it; skipped
    when SLURM cannot be installed here."""
    from slurm_cluster import LocalSlurm, SlurmError, ensure_slurm_installed

    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(f"no local SLURM: {reason}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmError as e:
        print(e)  # carries the daemon log tails
        raise
    saved = {k: os.environ.get(k) for k in cluster.env}
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        cluster.stop()


def hand_bits_per_byte(loss: float, *, next_token: bool, seq_len: int, batch: int, steps: int) -> float:
    """Bits per byte of a validation ``loss`` (nats per target) over the embedded corpus's first
    ``steps`` validation batches, counted by hand: the targets of those batches, and the bytes of
    the text they spell by decoding them (special tokens left out) and encoding the text as UTF-8."""
    import math

    from muloco.data.loader import PackedTextDataLoader
    from muloco.data.tokenizer import MulocoTokenizer

    tok = MulocoTokenizer()
    loader = PackedTextDataLoader.Config(split="validation", next_token=next_token).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=seq_len, local_batch_size=batch
    )
    targets: list[int] = []
    for index, (_, labels) in enumerate(loader):
        if index == steps:
            break
        targets += [t for t in labels.flatten().tolist() if t != -100]
    special = {tok.bos_id, tok.eos_id, tok.mask_id}
    text = tok.decode([t for t in targets if t not in special])
    return loss * len(targets) / len(text.encode("utf-8")) / math.log(2)


def _interrupt_on_sigterm(signum, frame) -> None:
    """SIGTERM (a CI time limit, ``kill`` of the run) ends the suite as Ctrl-C does: the running
    tests unwind (their ``finally`` blocks and fixtures stop the processes they started, by PID)
    instead of the interpreter dying with them still running. It is passed on first to this
    process's own children (the controller's are its xdist workers, which only it was sent to; a
    worker's, the launchers and jobs its test started, which stop as they do on SIGTERM)."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def pytest_configure(config):
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


CHECKOUT_NOISE = ("__pycache__/", ".pytest_cache/", "muloco.egg-info/", ".venv")
"""What running Python and pytest in a checkout always leaves (and what setup made)."""


def _checkout_files() -> set[str] | None:
    """Untracked and ignored paths in the checkout (None: not a git checkout, or no git)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    paths = {line[3:] for line in out.stdout.splitlines() if line.startswith(("??", "!!"))}
    return {p for p in paths if not any(noise in p for noise in CHECKOUT_NOISE)}


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller: what the checkout held before the tests
        session.config._checkout_before = _checkout_files()


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves the checkout as it found it (a user's own runs in it stay theirs): a file a
    test wrote there fails the run, named."""
    before = getattr(session.config, "_checkout_before", None)
    after = _checkout_files() if before is not None else None
    if before is None or after is None or exitstatus not in (0, 1):
        return
    added = sorted(after - before)
    if added:
        sys.stderr.write(
            "\nthe tests wrote into the checkout (they must write under tmp_path): "
            + ", ".join(added[:20])
            + ("" if len(added) <= 20 else f" and {len(added) - 20} more")
            + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
