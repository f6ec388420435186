"""Defaults that fit the device: precision and where θ_g lives.

On this CPU machine the CUDA answers come from patching the device query torchtitan and
muloco ask (``torch._utils._get_available_device_type``); the pinned-memory path itself
runs where CUDA exists (the GPU host), and says so when skipped here.
"""

import pytest
import torch

import muloco.compat as compat

compat.apply()

from muloco.compat.cpu_device import device_type  # noqa: E402
from muloco.components.precision import resolve_precision  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.outer.optimizer import Nesterov  # noqa: E402
from muloco.outer.placement import Placement, resolve_backup_device  # noqa: E402


@pytest.fixture
def cuda_reported(monkeypatch):
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")


def test_precision_is_fp32_on_cpu_and_bf16_when_cuda_is_reported(monkeypatch, cuda_reported):
    _, config = parse_args(["--config", "diloco/muloco_2bit"])
    assert config.training.mixed_precision_param == "auto"
    assert config.training.mixed_precision_reduce == "float32"  # reductions stay fp32
    assert device_type() == "cuda"
    assert resolve_precision(config.training.mixed_precision_param, device_type()) == "bfloat16"
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: None)
    assert resolve_precision(config.training.mixed_precision_param, device_type()) == "float32"


@pytest.mark.parametrize("forced", ["bfloat16", "float32"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_switch_forces_either_precision(forced, device):
    _, config = parse_args(["--config", "ddp/adamw", "--training.mixed_precision_param", forced])
    assert resolve_precision(config.training.mixed_precision_param, device) == forced


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(ValueError, match="auto, bfloat16, float32; got 'fp8'"):
        resolve_precision("fp8", "cuda")


def test_theta_g_lives_on_the_accelerator_by_default_and_on_cpu_when_asked():
    assert parse_args(["--config", "diloco/muloco"])[1].outer.backup_device == "auto"
    cuda = torch.device("cuda", 3)
    assert resolve_backup_device("auto", cuda) == cuda
    assert resolve_backup_device("device", cuda) == cuda
    assert resolve_backup_device("cpu", cuda) == torch.device("cpu")
    cpu = torch.device("cpu")
    assert resolve_backup_device("auto", cpu) == resolve_backup_device("device", cpu) == cpu
    with pytest.raises(ValueError, match="auto, device, cpu; got 'gpu'"):
        resolve_backup_device("gpu", cuda)


def test_moves_on_one_device_are_no_copies():
    placement = Placement(torch.device("cpu"), torch.device("cpu"))
    ts = [torch.randn(3), torch.randn(2, 2)]
    assert placement.to_device(ts) is ts and placement.to_backup(ts) is ts
    locals_ = [torch.zeros(3), torch.zeros(2, 2)]
    placement.pull(locals_, ts, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(locals_, ts))
    placement.pull(locals_, [t + 2 for t in ts], 0.5)  # θ_l ← θ_g + ½(θ_l − θ_g)
    assert all(torch.allclose(a, b + 1) for a, b in zip(locals_, ts))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory path needs a CUDA device")
def test_pinned_placement_round_trips_and_steps_like_the_device_placement():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    init = [torch.randn(1000, 17, device=device), torch.randn(33, device=device)]
    results = {}
    for backup in ("cpu", "device"):
        placement = Placement(resolve_backup_device(backup, device), device)
        globals_ = [placement.home(t) for t in init]
        assert all(g.is_pinned() for g in globals_) == (backup == "cpu")
        opt = Nesterov.Config(lr=0.7, momentum=0.9).build(params=globals_, zeros_like=placement.zeros_like)
        locals_ = [t.clone() for t in init]
        for step in range(3):
            torch._foreach_add_(locals_, [torch.full_like(t, 0.01 * (step + 1)) for t in locals_])
            deltas = torch._foreach_sub(placement.to_device(globals_), locals_)
            opt.step(placement.to_backup(deltas))
            placement.pull(locals_, globals_, 0.0)
        torch.cuda.synchronize()
        results[backup] = [t.cpu() for t in locals_]
    for a, b in zip(results["cpu"], results["device"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
