"""muloco.compat: one or more tests per adaptation of third-party behaviour.

The adaptations patch process-global state that torchtitan copies at import
time, so everything about "before torchtitan is imported" runs in a fresh
interpreter (``_run_fresh``). Those children also show what goes wrong
*without* the adaptation, which is why each one exists. Everything else runs in
this process after ``muloco.compat.apply()``, which this module calls before it
imports torchtitan.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import run_watched

import muloco.compat as compat

compat.apply()  # before any torchtitan import in this module

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint.default_planner as default_planner  # noqa: E402
import torch.distributed.checkpoint.filesystem as dcp_filesystem  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from muloco.compat import checkpoint_safety, compile_on_first_call, cpu_device, distributed, triton_stub  # noqa: E402
from muloco.compat.checkpoint_safety import UnsafeCheckpointError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="shows CPU-only behaviour")
NO_TRITON = pytest.mark.skipif(triton_stub.triton_available(), reason="the stub is only installed without Triton")
PREFIX = "@@RESULT@@"


def _run_fresh(code: str, *args: str) -> dict:
    """Run `code` in a new interpreter; it reports by calling `report(dict)`."""
    prelude = f"import json, sys\ndef report(d):\n    print({PREFIX!r} + json.dumps(d), flush=True)\n"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = run_watched(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, f"child reported {len(lines)} results:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len(PREFIX) :])


class _MkdirOnUnpickle:
    """A harmless stand-in for malicious pickle payloads: unpickling it creates a folder."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class PlainPythonObject:
    """Any class from user code; not plain data, so a checkpoint has no reason to hold it."""

    def __init__(self):
        self.value = 1


def _save_checkpoint(folder: Path, state: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(folder))
    assert (folder / ".metadata").is_file()
    return folder


def _failure_messages(exc: BaseException) -> str:
    """DCP wraps every per-rank error in a CheckpointException (a BaseException)."""
    return str(exc)


def _failure_types(exc: BaseException) -> list[type]:
    if isinstance(exc, CheckpointException):
        return [type(e) for e, _ in exc.failures.values()]
    return [type(exc)]


# --------------------------------------------------------------- fresh processes


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory) -> dict:
    """torch/torchtitan as they behave without muloco.compat (fresh interpreter)."""
    folder = tmp_path_factory.mktemp("unpatched")
    ckpt = folder / "ckpt"
    ckpt.mkdir()
    marker = folder / "payload-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_MkdirOnUnpickle(marker)))
    result = _run_fresh(
        """
        import torch.distributed as dist
        out = {"has_set_timeout": hasattr(dist, "set_timeout")}
        import torchtitan.tools.utils as tt_utils
        out["device_type"] = tt_utils.device_type
        try:
            import torchtitan.trainer
            out["trainer_error"] = None
        except BaseException as err:
            out["trainer_error"] = [type(err).__name__, getattr(err, "name", None), str(err)]
        # torch's own DCP reader unpickles .metadata with plain pickle.load.
        import torch.distributed.checkpoint.filesystem as fs
        try:
            fs.FileSystemReader(sys.argv[1]).read_metadata()
        except BaseException as err:
            out["read_metadata_error"] = type(err).__name__
        # apply() after torchtitan was imported is too late, and says so.
        import muloco.compat as compat
        compat.apply()
        try:
            compat.assert_applied_before_torchtitan()
            out["late_apply_error"] = None
        except RuntimeError as err:
            out["late_apply_error"] = str(err)
        report(out)
        """,
        str(ckpt),
    )
    result["payload_ran"] = marker.exists()
    return result


@pytest.fixture(scope="module")
def patched() -> dict:
    """A fresh interpreter that calls muloco.compat.apply() first, as every entry point does."""
    return _run_fresh(
        """
        import muloco.compat as compat
        compat.apply()
        import torchtitan.tools.utils as tt_utils
        from torchtitan.components import metrics
        compat.assert_applied_before_torchtitan()  # must not raise
        report({
            "device_type": tt_utils.device_type,
            "metrics_device_type": metrics.device_type,
            "device_module": tt_utils.device_module.__name__,
        })
        """
    )


def test_device_type_is_the_machines_after_apply_in_fresh_process(patched):
    """cpu here; on a CUDA machine apply() changes nothing and torchtitan keeps cuda."""
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert patched == {
        "device_type": kind,
        "metrics_device_type": kind,
        "device_module": f"torch.{kind}",
    }


@NO_CUDA
def test_without_apply_torchtitan_picks_cuda_on_a_cpu_machine(unpatched):
    # This is why cpu_device exists: torchtitan falls back to "cuda" at import time.
    assert unpatched["device_type"] == "cuda"


@NO_CUDA
def test_apply_after_torchtitan_import_is_detected(unpatched):
    msg = unpatched["late_apply_error"]
    assert msg is not None, "assert_applied_before_torchtitan() should have raised"
    assert "'cuda'" in msg and "call muloco.compat.apply() first" in msg


@NO_TRITON
def test_without_stub_trainer_import_fails_for_missing_triton(unpatched):
    err = unpatched["trainer_error"]
    assert err is not None, "torchtitan.trainer imported without Triton and without the stub"
    name, missing, _ = err
    assert name == "ModuleNotFoundError" and missing == "triton"


def test_set_timeout_is_missing_from_torch(unpatched):
    # Why distributed adds the alias: torchtitan calls it after step 1.
    assert not unpatched["has_set_timeout"], "torch has set_timeout again; the alias is unused"


def test_plain_dcp_reader_runs_pickle_payloads(unpatched):
    # This is why checkpoint_safety exists: torch's reader runs code from .metadata.
    assert unpatched["payload_ran"]
    assert unpatched["read_metadata_error"] is not None  # os.mkdir returned None, not Metadata


# ------------------------------------------------------------------- cpu_device


@NO_CUDA
def test_no_accelerator_detected_here():
    assert not cpu_device.has_accelerator()
    assert cpu_device.device_type() == "cpu"
    assert torch._utils._get_available_device_type() == "cpu"


def test_in_process_torchtitan_uses_cpu():
    compat.assert_applied_before_torchtitan()
    from torchtitan.tools import utils as tt_utils

    assert tt_utils.device_type == cpu_device.device_type()


@NO_CUDA
def test_a_cpu_run_skips_the_gpu_peak_flops_lookup_and_the_nccl_overwrite_warning(monkeypatch, caplog):
    """torchtitan would run lspci and warn twice ("Error running lspci", "fallback to A100"), then warn
    that torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING is overwritten: none of it applies to a CPU run."""
    import logging
    import math

    from torchtitan.tools import utils as tt_utils

    monkeypatch.setattr(os, "environ", {**os.environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    cpu_device.quiet_gpu_only_warnings()
    with caplog.at_level(logging.WARNING):
        assert math.isnan(tt_utils.get_peak_flops("Intel(R) Xeon(R) CPU"))
    assert not caplog.records and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


def test_the_fault_tolerant_trainers_model_config_is_one_line():
    import logging

    from muloco.compat.model_config_log import OneLineModelConfig

    record = logging.LogRecord(
        "root", logging.INFO, __file__, 1, 'Building llama3 tiny with {\n  "dim": 64\n}', None, None
    )
    assert OneLineModelConfig().filter(record) and "\n" not in record.getMessage()
    assert record.getMessage().startswith("Building llama3 tiny (its settings:")
    other = logging.LogRecord("root", logging.INFO, __file__, 1, "Building the dataloader", None, None)
    assert OneLineModelConfig().filter(other) and other.getMessage() == "Building the dataloader"
    assert any(isinstance(f, OneLineModelConfig) for f in logging.getLogger().filters)  # compat.apply put it there


@NO_CUDA
def test_device_memory_monitor_reports_peak_rss():
    from torchtitan.components.metrics import DeviceMemoryMonitor, build_device_memory_monitor

    monitor = build_device_memory_monitor()
    assert isinstance(monitor, DeviceMemoryMonitor)
    assert monitor.device == torch.device("cpu")
    assert monitor.device_capacity_gib > 0
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib > 0
    assert stats.max_active_gib > 0
    assert 0 < stats.max_reserved_pct < 100
    assert stats.num_alloc_retries == 0 and stats.num_ooms == 0
    # The figure is the peak resident set size, so not below the current one (the
    # kernel's high-water mark lags RSS by a few pages, hence the margin).
    rss_kib = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")
    )
    assert stats.max_reserved_gib * 2**30 >= 0.95 * rss_kib * 1024
    monitor.reset_peak_stats()  # a no-op on CPU, but it must not fail
    assert monitor.get_peak_stats().max_reserved_gib >= stats.max_reserved_gib


# ------------------------------------------------------------------ triton_stub


@NO_TRITON
def test_trainer_imports_and_triton_kernels_fail_clearly():
    import torchtitan.trainer  # noqa: F401
    from torchtitan.distributed.minimal_async_ep import kernels

    assert isinstance(kernels, triton_stub._MissingTritonKernels)
    kernel = kernels.fill_dispatch_metadata_kernel
    with pytest.raises(RuntimeError, match="needs Triton"):
        kernel(torch.zeros(1))
    # Dunder look-ups stay normal AttributeErrors (introspection, pickling, copy).
    assert not hasattr(kernels, "__wrapped__")
    # The names torchtitan imported from the stub fail the same way when used.
    from torchtitan.distributed.minimal_async_ep import api

    with pytest.raises(RuntimeError, match="Triton"):
        api.fill_dispatch_metadata_kernel()


# ------------------------------------------------------------------ distributed


@pytest.fixture
def gloo_world(tmp_path):
    """A real one-rank gloo process group; destroyed afterwards whatever happens."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


def test_set_timeout_alias_exists():
    assert callable(dist.set_timeout)


@NO_CUDA
def test_set_pg_timeouts_without_device_ids_on_gloo(gloo_world):
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    parallel_dims = ParallelDims.from_config(ParallelismConfig(), 1)
    backend = gloo_world._get_backend(torch.device("cpu"))
    assert backend.options._timeout != timedelta(seconds=30)

    # torchtitan's trainer calls this module attribute; it is ours on CPU.
    assert dist_utils.set_pg_timeouts is distributed.set_pg_timeouts_without_device_ids
    dist_utils.set_pg_timeouts(timedelta(seconds=30), parallel_dims)
    assert backend.options._timeout == timedelta(seconds=30)


@NO_CUDA
def test_torchtitan_barrier_with_device_ids_fails_on_cpu(gloo_world):
    # What torchtitan's own set_pg_timeouts does first (distributed/utils.py:586):
    # on CPU, current_device() is the string "cpu", which BarrierOptions rejects.
    with pytest.raises(TypeError):
        dist.barrier(device_ids=[torch.cpu.current_device()])
    dist.barrier()  # the plain barrier we use instead works


# ------------------------------------------------------------ checkpoint_safety


def test_loaders_are_patched():
    assert dcp_filesystem.FileSystemReader.read_metadata is checkpoint_safety.safe_read_metadata
    assert default_planner.DefaultLoadPlanner.load_bytes is checkpoint_safety.safe_load_bytes


def test_safe_reader_reads_real_dcp_metadata(tmp_path):
    ckpt = _save_checkpoint(tmp_path / "ckpt", {"w": torch.arange(4.0), "step": 3})
    metadata = dcp_filesystem.FileSystemReader(str(ckpt)).read_metadata()
    assert set(metadata.state_dict_metadata) == {"w", "step"}


def test_dcp_round_trip_after_apply(tmp_path):
    ckpt = _save_checkpoint(tmp_path / "ckpt", {"w": torch.arange(4.0), "meta": {"step": 3, "names": ["a"]}})
    loaded = {"w": torch.zeros(4), "meta": {"step": 0, "names": []}}
    dcp.load(loaded, checkpoint_id=str(ckpt))
    assert torch.equal(loaded["w"], torch.arange(4.0))
    assert loaded["meta"] == {"step": 3, "names": ["a"]}


def test_malicious_metadata_is_refused_without_running_it(tmp_path):
    ckpt = _save_checkpoint(tmp_path / "ckpt", {"w": torch.arange(4.0)})
    marker = tmp_path / "payload-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_MkdirOnUnpickle(marker)))

    with pytest.raises(UnsafeCheckpointError, match="posix.mkdir|os.mkdir"):
        dcp_filesystem.FileSystemReader(str(ckpt)).read_metadata()
    assert not marker.exists()

    # Through dcp.load the error arrives wrapped by DCP, with our message in it.
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=str(ckpt))
    assert "not a DCP metadata type" in _failure_messages(info.value)
    assert not marker.exists()


def test_print_payload_in_metadata_is_not_run(tmp_path, capfd):
    class Pwn:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Pwn()))
    with open(path, "rb") as f, pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        checkpoint_safety.MetadataUnpickler(f).load()
    assert "pwned" not in capfd.readouterr().out


def test_metadata_unpickler_admits_dcp_metadata_types():
    from torch.distributed.checkpoint import metadata as m

    value = m.Metadata(
        state_dict_metadata={
            "w": m.TensorStorageMetadata(
                properties=m.TensorProperties(dtype=torch.bfloat16),
                size=torch.Size([4]),
                chunks=[m.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))],
            ),
            "step": m.BytesStorageMetadata(),
        },
        storage_data={
            m.MetadataIndex("w", torch.Size([0]), 0): dcp_filesystem._StorageInfo(
                relative_path="__0_0.distcp", offset=0, length=16
            )
        },
        storage_meta=m.StorageMeta(checkpoint_id=Path("/tmp/ckpt")),
    )
    # TensorProperties pickles its layout through torch.serialization._get_layout,
    # and storage_meta.checkpoint_id is a pathlib path: both must be admitted, or
    # no real checkpoint loads.
    loaded = checkpoint_safety.MetadataUnpickler(io.BytesIO(pickle.dumps(value))).load()
    assert loaded.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert loaded.state_dict_metadata["w"].size == torch.Size([4])
    assert loaded.state_dict_metadata["w"].properties.layout == torch.strided
    assert loaded.storage_meta.checkpoint_id == Path("/tmp/ckpt")


def test_non_plain_value_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save(PlainPythonObject(), buf)
    buf.seek(0)
    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        checkpoint_safety._load_plain(buf)

    marker = tmp_path / "payload-ran"
    buf = io.BytesIO()
    torch.save({"step": 1, "evil": _MkdirOnUnpickle(marker)}, buf)
    buf.seek(0)
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_safety._load_plain(buf)
    assert not marker.exists()


def test_plain_values_load():
    buf = io.BytesIO()
    value = {"step": 3, "names": ["a"], "lr": 0.5, "t": torch.ones(2), "nested": (1, None)}
    torch.save(value, buf)
    buf.seek(0)
    loaded = checkpoint_safety._load_plain(buf)
    assert loaded["step"] == 3 and loaded["names"] == ["a"] and loaded["nested"] == (1, None)
    assert torch.equal(loaded["t"], torch.ones(2))


def test_dcp_load_refuses_arbitrary_object_value(tmp_path):
    marker = tmp_path / "payload-ran"
    ckpt = _save_checkpoint(tmp_path / "ckpt", {"obj": PlainPythonObject(), "evil": _MkdirOnUnpickle(marker)})
    assert not marker.exists()
    # The metadata itself is plain DCP metadata; only the values are refused.
    dcp_filesystem.FileSystemReader(str(ckpt)).read_metadata()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"obj": None, "evil": None}, checkpoint_id=str(ckpt))
    assert not marker.exists()
    assert UnsafeCheckpointError in _failure_types(info.value)
    assert "not plain data" in _failure_messages(info.value)


# -------------------------------------------------------------------- apply()


def _patched_state() -> dict:
    import torchtitan.distributed.utils as dist_utils

    return {
        "device_type_fn": torch._utils._get_available_device_type,
        "cpu_api": {name: getattr(torch.cpu, name, None) for name in cpu_device._CPU_MEMORY_API},
        "kernels": sys.modules.get(triton_stub.KERNELS_MODULE),
        "set_timeout": getattr(dist, "set_timeout", None),
        "set_pg_timeouts": dist_utils.set_pg_timeouts,
        "read_metadata": dcp_filesystem.FileSystemReader.read_metadata,
        "load_bytes": default_planner.DefaultLoadPlanner.load_bytes,
    }


def test_apply_is_idempotent():
    before = _patched_state()
    compat.apply()
    # Each adaptation on its own, too (apply() itself only runs them once).
    for module in (cpu_device, triton_stub, distributed, checkpoint_safety, compile_on_first_call):
        module.apply()
        module.apply()
    assert sum(isinstance(f, compile_on_first_call._AttentionFinder) for f in sys.meta_path) <= 1
    after = _patched_state()
    assert after == before
    assert torch._utils._get_available_device_type() == cpu_device.device_type()
    if not cpu_device.has_accelerator():
        # The device-type wrapper was not wrapped again.
        assert getattr(after["device_type_fn"], "_muloco_patched", False)
        assert after["cpu_api"] == dict(cpu_device._CPU_MEMORY_API)


# ---------------------------------------------------------------- healing transport
class _Payload:
    """Not a tensor or container: a peer sending this must not get it unpickled."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _serve_and_fetch(transport_cls, state, mutate=None):
    from muloco.compat.healing_transport import SafeHTTPTransport  # noqa: F401

    sender = transport_cls(timeout=timedelta(seconds=10), num_chunks=0)
    receiver = transport_cls(timeout=timedelta(seconds=10), num_chunks=0)
    try:
        sender.send_checkpoint([1], step=3, state_dict=state, timeout=timedelta(seconds=10))
        if mutate:
            mutate()
        meta = sender.metadata().replace(sender.metadata().split("//")[1].split(":")[0], "127.0.0.1")
        return receiver.recv_checkpoint(src_rank=0, metadata=meta, step=3, timeout=timedelta(seconds=10))
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_healing_state_is_a_snapshot_taken_when_staged():
    from torchft.checkpointing.http_transport import HTTPTransport

    from muloco.compat.healing_transport import SafeHTTPTransport

    for cls, expect in ((HTTPTransport, 5.0), (SafeHTTPTransport, 1.0)):
        w = torch.ones(4)
        got = _serve_and_fetch(cls, {"w": w, "step": 3}, mutate=lambda: w.fill_(5.0))
        assert float(got["w"][0]) == expect and got["step"] == 3  # stock torchft serves live tensors


def test_healing_state_from_a_peer_is_never_unpickled():
    from muloco.compat.healing_transport import SafeHTTPTransport

    with pytest.raises(pickle.UnpicklingError, match="unsupported GLOBAL|Weights only load failed"):
        _serve_and_fetch(SafeHTTPTransport, {"w": torch.ones(2), "evil": _Payload()})


# --------------------------------------------------------------- FSDP2 over gloo

_FSDP_GLOO = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from muloco.compat.fsdp_gloo import force_sum_reduction_on_gloo
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6, bias=False)
    full = model.weight.detach().clone()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    model.set_gradient_divide_factor(1.0)   # as torchtitan: not the group size -> PREMUL_SUM
    if sys.argv[1] == "fixed":
        assert force_sum_reduction_on_gloo(model) == 1
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        model(x).square().sum().backward()
    except RuntimeError as err:
        print("ERROR", str(err).splitlines()[0], flush=True)
        sys.exit(0)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    want = sum(2 * (full @ xi.T) @ xi for xi in xs)   # summed over ranks (divide factor 1)
    got = model.weight.grad.full_tensor()
    print("MAXERR", float((got - want).abs().max()), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # what is under test is done; interpreter teardown with gloo threads once aborted here
    """
)


def _fsdp_gloo(tmp_path: Path, mode: str) -> str:
    from conftest import run_gloo_ranks

    script = tmp_path / "fsdp_gloo.py"
    script.write_text(_FSDP_GLOO)
    results = run_gloo_ranks(script, 2, [mode], quiet_s=240)
    assert all(code == 0 for code, _ in results), [out for _, out in results]
    return results[0][1]


@pytest.mark.timeout(300)
def test_fsdp_reduce_scatter_fails_on_gloo_without_force_sum(tmp_path):
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in _fsdp_gloo(tmp_path, "stock")


@pytest.mark.timeout(300)
def test_force_sum_reduction_gives_the_same_gradient_on_gloo(tmp_path):
    out = _fsdp_gloo(tmp_path, "fixed")
    err = float(next(ln for ln in out.splitlines() if ln.startswith("MAXERR")).split()[1])
    assert err < 1e-4, out


# -- torchrun_failures: each failed attempt of a torchrun worker group, as it happens ---------


@pytest.mark.timeout(300)
def test_torchrun_reports_each_failed_attempt_and_ends_with_the_ranks_status(tmp_path):
    """A real torchrun (muloco.launch.replica_group) whose rank 1 fails with code 7 every time:
    one report per attempt (torch only logs the restart at INFO, without the code), torch's
    own ERROR record replaced by it, and the agent ends with 7 (torchrun's main: 1).

    Each rank of each attempt leaves a file of its own (the ranks share the agent's pipes, where
    their lines interleave); rank 0 may be stopped before it writes, so only rank 1's count."""
    worker = textwrap.dedent(f"""
        import os, sys
        name = f"attempt{{os.environ['TORCHELASTIC_RESTART_COUNT']}}-rank{{os.environ['LOCAL_RANK']}}"
        with open(os.path.join({str(tmp_path)!r}, name), "a") as f:
            f.write("ran\\n")
        sys.exit(7 if os.environ["LOCAL_RANK"] == "1" else 0)
    """)
    proc = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.launch.replica_group",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "--max-restarts",
            "1",
            "--no-python",
            sys.executable,
            "-c",
            worker,
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 7, out
    # each report's text is one write of the agent's: found wherever it lands among other output
    reports = re.findall(
        r"\[muloco\] rank (\d+) \(pid \d+\) exited with code 7; (restart 1/1|no restart left)", proc.stderr
    )
    assert reports == [("1", "restart 1/1"), ("1", "no restart left")], out
    assert "failed (exitcode" not in out
    ran = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.endswith("-rank1")}
    assert ran == {"attempt0-rank1": "ran\n", "attempt1-rank1": "ran\n"}, out


def test_torchrun_failure_record_is_the_one_the_hook_reads():
    """The hook reads the arguments of torch's ERROR record by position; a record of that
    shape goes to the callback and is dropped, any other passes untouched."""
    import logging

    from muloco.compat.torchrun_failures import ELASTIC_API_LOGGER, on_worker_failure

    seen = []
    f = on_worker_failure(seen.append)
    logger = logging.getLogger(ELASTIC_API_LOGGER)
    try:
        failed = logger.makeRecord(
            ELASTIC_API_LOGGER,
            logging.ERROR,
            __file__,
            1,
            "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
            (-9, 2, 4242, "python"),
            None,
        )
        other = logger.makeRecord(
            ELASTIC_API_LOGGER,
            logging.WARNING,
            __file__,
            1,
            "Sending process %s closing signal %s",
            (1, "SIGTERM"),
            None,
        )
        assert f.filter(failed) is False and f.filter(other) is True
        assert [(s.exitcode, s.local_rank, s.pid) for s in seen] == [(-9, 2, 4242)]
    finally:
        logger.removeFilter(f)


@pytest.mark.parametrize("trainer_module", ["torchtitan.trainer", "torchtitan.experiments.torchft.trainer"])
def test_lone_rank_skips_torchtitans_end_of_training_sleep(trainer_module, monkeypatch, tmp_path):
    """torchtitan's trainers (the plain one, and the torchft experiment's under the DiLoCo trainer)
    sleep 2 s at the end "for other ranks"; in a world of one it is skipped, with more ranks (or no
    process group) it is the real sleep; the rest is ``time``."""
    import importlib
    import time

    import torch.distributed as dist

    import muloco.diloco_trainer  # noqa: F401  (applies it to both)
    from muloco.compat import lone_rank_sleep

    titan = importlib.import_module(trainer_module)
    slept = []
    monkeypatch.setattr(lone_rank_sleep._time, "sleep", slept.append)
    assert titan.time.perf_counter is time.perf_counter
    titan.time.sleep(2)  # no process group: the real sleep
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        titan.time.sleep(2)  # a world of one: nobody to wait for
    finally:
        dist.destroy_process_group()
    assert slept == [2]
    lone_rank_sleep.apply(titan)  # idempotent
    assert isinstance(titan.time, lone_rank_sleep._TimeSkippingLoneSleep)


def test_a_trainer_process_imports_neither_datasets_nor_inductor_until_used(tmp_path):
    """A process that imports torchtitan's trainer no longer imports the ``datasets`` package (and
    pandas and pyarrow with it); torchtitan's text dataloader module still reaches the real one
    through its names when used, and ``import datasets`` anywhere gets the real package. Nor does
    it import inductor's ``compile_fx`` for the two functions torchtitan's attention module compiles
    at import: they compile on their first call, and ``torch.compile`` is the real one again."""
    code = textwrap.dedent("""
        import sys
        import torch
        real_compile = torch.compile
        from muloco import compat
        compat.apply()  # as every entry point does first
        import muloco.diloco_trainer  # torchtitan's trainers, model, validator and text dataloader module
        from torchtitan.hf_datasets import text_datasets as td
        from torchtitan.models.common import attention
        assert "datasets" not in sys.modules and "pandas" not in sys.modules, "imported at start-up"
        assert "torch._inductor.compile_fx" not in sys.modules, "inductor imported at start-up"
        assert torch.compile is real_compile
        flex = attention.FlexAttention._compiled_flex_attn
        assert flex.__name__ == "flex_attention" and flex.__code__.co_name == "compiles_on_first_call"
        import datasets
        from datasets.distributed import split_dataset_by_node
        assert datasets.__file__ and td.Dataset is not datasets.Dataset  # the real package, td's stand-in
        ds = td.load_dataset("json", data_files={"train": sys.argv[1]}, split="train")
        assert isinstance(ds, td.Dataset) and isinstance(ds, datasets.Dataset)
        assert not isinstance(object(), td.Dataset) and issubclass(datasets.Dataset, td.Dataset)
        half = td.split_dataset_by_node(ds, rank=1, world_size=2)
        assert len(half) == 2 and half["text"] == split_dataset_by_node(ds, rank=1, world_size=2)["text"]
        print("ok")
    """)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in "abcd"))
    ran = run_watched(
        [sys.executable, "-c", code, str(rows)],
        cwd=REPO,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-3000:]


def test_a_deferred_compile_compiles_a_function_once_on_its_first_call_and_leaves_modules_alone():
    from muloco.compat.compile_on_first_call import compile_on_first_call

    calls = []

    def counting_compile(*args, **kwargs):
        calls.append(kwargs)
        return torch.compile(*args, **kwargs)

    def double(x):
        return 2 * x

    deferred = compile_on_first_call(counting_compile)
    doubled = deferred(double, backend="eager")
    assert calls == [] and doubled.__name__ == "double" and doubled.__wrapped__ is double
    x = torch.arange(4.0)
    assert torch.equal(doubled(x), 2 * x) and torch.equal(doubled(x + 1), 2 * x + 2)
    assert calls == [{"backend": "eager"}]  # once, with the options it was given
    module = deferred(torch.nn.Linear(2, 2), backend="eager")  # a module: compiled now, as torch.compile does
    assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule) and len(calls) == 2
    assert callable(deferred(backend="eager")) and len(calls) == 3  # the decorator form


def test_with_an_accelerator_torchtitans_import_time_compile_is_left_alone(monkeypatch):
    finder = compile_on_first_call._AttentionFinder
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, finder)])
    monkeypatch.delitem(sys.modules, compile_on_first_call.ATTENTION, raising=False)
    monkeypatch.setattr(cpu_device, "has_accelerator", lambda: True)
    compile_on_first_call.apply()
    assert not any(isinstance(f, finder) for f in sys.meta_path)
    monkeypatch.setattr(cpu_device, "has_accelerator", lambda: False)
    compile_on_first_call.apply()
    assert sum(isinstance(f, finder) for f in sys.meta_path) == 1


@pytest.mark.parametrize("user_level, quorum_lines", [(None, False), ("info", True)])
def test_torchfts_rust_log_is_quiet_unless_the_user_asks(user_level, quorum_lines):
    """torchft logs every lighthouse tick at INFO unless RUST_LOG is set before its import:
    ``compat.apply()`` sets warn; a user's own RUST_LOG wins."""
    code = (
        "import time; from muloco import compat; compat.apply(); "
        "from torchft.coordination import LighthouseServer; "
        "s = LighthouseServer(bind='127.0.0.1:0', min_replicas=1); time.sleep(0.3); s.shutdown()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    if user_level:
        env["RUST_LOG"] = user_level
    proc = run_watched([sys.executable, "-c", code], cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("[INFO] [torchft::lighthouse]" in proc.stderr) is quorum_lines, proc.stderr


def test_the_llama_adapter_ignores_the_tokenizer_assets_folder_and_maps_like_torchtitans(tmp_path, caplog):
    """No 'model.safetensors.index.json not found' warning for muloco's tokenizer-only assets
    folder, and the same Hugging Face names and Q/K permutation as torchtitan's adapter."""
    import logging

    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from muloco.config.cli import parse_args
    from muloco.hf.adapter import Llama3Adapter
    from muloco.models import build_model_config, hf_adapter, init_model

    _, c = parse_args(["--config", "ddp/adamw", "--model.flavor", "llama3-w64-d2-h2"])
    assert hf_adapter(c.model) is Llama3Adapter
    mc = build_model_config(c.model, 2048, True)
    with caplog.at_level(logging.WARNING):
        ours = Llama3Adapter(mc, str(tmp_path))  # a folder without an index, like the tokenizer assets
    assert "index.json not found" not in caplog.text and ours.fqn_to_index_mapping is None
    state = init_model(c.model, 2048, True, torch.device("cpu")).state_dict()
    theirs = Llama3StateDictAdapter(mc, None).to_hf(state)
    mine = ours.to_hf(state)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    back = ours.from_hf(mine)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_lighthouse_process_loads_no_torch_and_a_later_torchft_import_shares_its_server_class():
    """torchft_native: the lighthouse starts from torchft's Rust extension alone (torchft's
    package imports torch, seconds of a busy node's CPU), and importing torchft afterwards in the
    same process finds the same extension module instead of initialising it twice."""
    script = textwrap.dedent("""
        import sys
        from muloco.launch.lighthouse import start_lighthouse
        lighthouse = start_lighthouse(min_replicas=1)
        assert lighthouse.port > 0
        assert "torch" not in sys.modules and "torchft" not in sys.modules, "torch or torchft was imported"
        from torchft.coordination import LighthouseServer
        assert type(lighthouse.server) is LighthouseServer
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_compat_package_itself_imports_no_torch():
    """A torch-free module of compat (the Rust log level, torchrun's failure hook's data) costs
    nothing beyond itself: the package's torch-bound adaptations load in apply()."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, muloco.compat, muloco.compat.torchft_log_level; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-3000:]


def test_set_position_matches_a_scheduler_stepped_there_without_warning():
    """Deadline rounds jump the inner scheduler to a step: torchtitan's warmup-decay LambdaLR put
    at step n holds the lrs (and reports the last lr) that one stepped n times holds, says
    nothing, and goes on from there as that one does."""
    import warnings

    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from muloco.compat.lr_position import set_position

    def schedulers():
        optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.3)]
        config = LRSchedulersContainer.Config(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1)
        return optimizers, config.build(optimizers=optimizers, training_steps=20)

    stepped_opt, stepped = schedulers()
    jumped_opt, jumped = schedulers()
    for n in [7, 1, 15]:  # forward and back
        stepped_opt, stepped = schedulers()
        for _ in range(n):
            stepped_opt[0].step()
            stepped.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for scheduler in jumped.schedulers:
                set_position(scheduler, n)
        assert jumped.schedulers[0].last_epoch == n
        assert jumped_opt[0].param_groups[0]["lr"] == stepped_opt[0].param_groups[0]["lr"] != 0.3
        assert jumped.schedulers[0].get_last_lr() == stepped.schedulers[0].get_last_lr()
    jumped_opt[0].step()
    jumped.step()
    stepped_opt[0].step()
    stepped.step()
    assert jumped_opt[0].param_groups[0]["lr"] == stepped_opt[0].param_groups[0]["lr"]
