"""One GPU slice per replica group: the launcher's layout for K, N and visible devices."""

from __future__ import annotations

import io
import os
import sys

import pytest
from conftest import REPO, run_watched

from muloco.launch.gpu_slices import GpuLayoutError, gpu_slices, visible_gpus
from muloco.launch.local import LocalJob

EIGHT = [str(i) for i in range(8)]


@pytest.mark.parametrize(
    "k,n,expected",
    [
        (2, None, [["0", "1", "2", "3"], ["4", "5", "6", "7"]]),  # default: split evenly
        (4, None, [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]),
        (8, None, [[str(i)] for i in range(8)]),
        (3, None, [["0", "1"], ["2", "3"], ["4", "5"]]),  # 8 // 3 = 2; devices 6, 7 unused
        (2, 1, [["0"], ["1"]]),
        (4, 2, [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]),
    ],
)
def test_groups_get_disjoint_slices_of_the_visible_gpus(k, n, expected):
    assert gpu_slices(EIGHT, k, n) == expected


def test_visible_devices_keep_their_ids_and_order():
    assert gpu_slices(["3", "GPU-ab12", "5", "7"], 2) == [["3", "GPU-ab12"], ["5", "7"]]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 6,7"}) == ["4", "6", "7"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize(
    "visible,k,n,match",
    [
        (EIGHT, 4, 4, "4 replica group\\(s\\) x 4 GPU\\(s\\) each need 16 GPUs; 8 visible"),
        (["0"], 2, None, "2 replica group\\(s\\) x 1 GPU\\(s\\) each need 2 GPUs; 1 visible .*--share-gpus"),
        ([], 2, 1, "--gpus-per-replica 1 but no GPU is visible"),
        (EIGHT, 2, 0, "at least 1"),
    ],
)
def test_too_few_gpus_is_a_clear_error(visible, k, n, match):
    with pytest.raises(GpuLayoutError, match=match):
        gpu_slices(visible, k, n)


def test_shared_gpus_put_several_groups_on_one_device():
    assert gpu_slices(["0"], 3, share=True) == [["0"], ["0"], ["0"]]
    assert gpu_slices(["0", "1"], 3, 1, share=True) == [["0"], ["1"], ["0"]]
    with pytest.raises(GpuLayoutError, match="more than the 2 visible"):
        gpu_slices(["0", "1"], 2, 3, share=True)


def test_no_gpu_means_cpu_and_no_device_variable():
    assert gpu_slices([], 4) is None


def test_each_rank_sees_its_groups_slice_and_counts_local_ranks_in_it(tmp_path):
    job = LocalJob(
        config="diloco/diloco",
        replicas=2,
        visible_gpus=["0", "1", "2", "3"],
        overrides=["--dump_folder", str(tmp_path / "run")],
        console=io.StringIO(),
    )
    job.validate()
    job.lighthouse_url = "http://127.0.0.1:1"
    assert job.procs_per_replica == 2  # one rank per GPU of the slice
    env, cmd = job.group_env(1), job.group_command(1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # torchrun gives its ranks LOCAL_RANK 0 and 1
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    cpu = LocalJob(config="diloco/diloco", replicas=2, visible_gpus=[], console=io.StringIO())
    cpu.validate()
    assert cpu.procs_per_replica == 1 and cpu.slices is None


def test_procs_per_replica_that_contradicts_the_slice_is_refused():
    job = LocalJob(replicas=2, procs_per_replica=3, visible_gpus=EIGHT, console=io.StringIO())
    with pytest.raises(Exception, match="--procs-per-replica 3 does not match the 4 GPU"):
        job.validate()


def _launcher(args, env_extra, tmp_path):
    env = {**os.environ, **env_extra}
    return run_watched(
        [sys.executable, "-m", "muloco.launch.local", *args, "--", "--dump_folder", str(tmp_path / "run")],
        cwd=REPO,
        env=env,
    )


@pytest.mark.timeout(150)
def test_dry_run_on_an_eight_gpu_node_prints_each_slice_and_starts_nothing(tmp_path):
    proc = _launcher(["--dry-run", "--replicas", "4"], {"CUDA_VISIBLE_DEVICES": ",".join(EIGHT)}, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "4 replica group(s) x 2 rank(s), 2 GPU(s) per group" in out and "nothing is started" in out
    lines = out.splitlines()
    for i in range(4):
        env = next(x for x in lines if x.startswith(f"[r{i}] CUDA_VISIBLE_DEVICES="))
        assert f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1} " in env and f" REPLICA_GROUP_ID={i} " in env
        torchrun = next(x for x in lines if x.startswith(f"[r{i}]   "))
        assert "-m muloco.launch.replica_group " in torchrun and " --nproc-per-node 2 " in torchrun
        assert f"--fault_tolerance.replica_id {i} " in torchrun
        for rank in range(2):
            assert (
                f"[r{i}.{rank}]   rank {rank}: torchrun sets RANK={rank} LOCAL_RANK={rank} "
                f"WORLD_SIZE=2  (cuda:{rank} = GPU {2 * i + rank} of this machine)"
            ) in lines
    assert "[lh] " in out and "min_replicas 3" in out
    assert not (tmp_path / "run").exists()  # no dump folder, no lock, no logs


@pytest.mark.timeout(150)
def test_too_few_gpus_stops_the_launcher_with_exit_2(tmp_path):
    proc = _launcher(
        ["--dry-run", "--replicas", "4", "--gpus-per-replica", "2"], {"CUDA_VISIBLE_DEVICES": "0,1,2"}, tmp_path
    )
    assert proc.returncode == 2
    assert "4 replica group(s) x 2 GPU(s) each need 8 GPUs; 3 visible (0, 1, 2)" in proc.stdout
    assert not (tmp_path / "run").exists()
