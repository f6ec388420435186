"""What the generated SLURM scripts say, read without training anything: values quoted for sbatch,
control characters refused, a failing setup line stopping the job, the pass-through options,
``--mem`` scaled to an array task's share of a node, and (on the real local SLURM) a user's
``--dependency`` kept when the groups array also waits for its lighthouse."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import run_watched

from muloco.launch.slurm.cluster import ClusterError, ClusterSettings, NodeInfo, check_request, resolve_partition
from muloco.launch.slurm.jobs import JobSpec, Script, main, preamble, sbatch_value, scale_mem, submit_scripts

CPU = ["--gpus-per-node", "0", "--cpus-per-node", "2", "--dry-run"]


def _dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_sbatch_values_are_double_quoted_with_quotes_and_backslashes_escaped():
    assert sbatch_value("job-name", "plain") == '"plain"'
    assert sbatch_value("job-name", 'a "b" \\ $(c) #d') == '"a \\"b\\" \\\\ $(c) #d"'


@pytest.mark.parametrize("bad", ["two\nlines", "tab\there", "cr\rhere"])
def test_a_control_character_in_a_job_value_is_one_clear_error(capsys, bad):
    code, out, err = _dry_run(capsys, "ddp", "--config", "ddp/adamw", *CPU, "--job-name", bad)
    assert code == 2 and "contains a control character" in err and "#SBATCH" not in out


def test_a_backslash_in_the_run_folder_is_refused_and_a_percent_escaped(capsys, tmp_path):
    code, _, err = _dry_run(capsys, "ddp", "--config", "ddp/adamw", *CPU, "--", "--dump_folder", str(tmp_path / "a\\b"))
    assert code == 2 and "contains a backslash" in err
    code, out, _ = _dry_run(
        capsys, "ddp", "--config", "ddp/adamw", *CPU, "--", "--dump_folder", str(tmp_path / "50% done")
    )
    assert code == 0
    assert f'#SBATCH --output="{tmp_path}/50%% done/slurm/%x-%j.out"' in out


def test_pass_through_options_reach_the_groups_and_not_the_lighthouse(capsys):
    code, out, err = _dry_run(
        capsys,
        "array",
        "--config",
        "diloco/muloco",
        "--replicas",
        "2",
        *CPU,
        "--exclusive",
        "--exclude",
        "node[1-2]",
        "--reservation",
        "lab week",
        "--gres",
        "gpu:h100:8",
        "--mail-type",
        "END,FAIL",
        "--mail-user",
        "me@example.org",
    )
    assert code == 0, err
    groups, lighthouse = out.split("lighthouse.sh (dry run")
    wanted = [
        "#SBATCH --exclusive",
        '#SBATCH --exclude="node[1-2]"',
        '#SBATCH --reservation="lab week"',
        '#SBATCH --gres="gpu:h100:8"',
        '#SBATCH --mail-type="END,FAIL"',
        '#SBATCH --mail-user="me@example.org"',
    ]
    assert set(wanted) <= set(_sbatch_lines(groups))
    lh = _sbatch_lines(lighthouse)
    assert '#SBATCH --reservation="lab week"' in lh and '#SBATCH --exclude="node[1-2]"' in lh
    assert not [line for line in lh if "exclusive" in line or "gres" in line or "mail" in line]


def _fake_sinfo(monkeypatch, tmp_path, body: str) -> None:
    """Put a ``sinfo`` shell script with ``body`` first on PATH: the cluster a dry run is checked
    against, whatever SLURM this machine has up."""
    fake = tmp_path / "bin" / "sinfo"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def gpu_cluster(monkeypatch, tmp_path):
    """A fake sinfo that reports one 8-GPU node, so a GPU layout's dry run is checked against a GPU
    cluster whether or not this machine's own (CPU-only) test SLURM is up."""
    _fake_sinfo(
        monkeypatch,
        tmp_path,
        'case " $* " in *" -N "*) echo "gpu*|n1|96|gpu:h100:8|1000000|idle|infinite";; *) echo "gpu*";; esac',
    )


def test_array_tasks_ask_for_their_share_of_a_nodes_memory(capsys, gpu_cluster):
    code, out, err = _dry_run(
        capsys,
        "array",
        "--config",
        "diloco/muloco",
        "--replicas",
        "4",
        "--dry-run",
        "--gpus-per-node",
        "8",
        "--gpus-per-replica",
        "2",
        "--cpus-per-node",
        "96",
        "--mem",
        "512G",
    )
    assert code == 0, err
    groups = _sbatch_lines(out.split("lighthouse.sh (dry run")[0])
    assert '#SBATCH --mem="131072M"' in groups and "#SBATCH --cpus-per-task=24" in groups
    assert scale_mem("64G", 1, 8) == "8192M" and scale_mem("1000", 1, 2) == "500M"
    code, _, err = _dry_run(capsys, "array", "--config", "diloco/muloco", "--replicas", "2", *CPU, "--mem", "lots")
    assert code == 2 and "mem 'lots' is not SLURM's format" in err


def test_an_any_of_dependency_cannot_join_the_lighthouse_dependency(capsys):
    code, _, err = _dry_run(
        capsys, "array", "--config", "diloco/muloco", "--replicas", "2", *CPU, "--dependency", "afterok:1?afterok:2"
    )
    assert code == 2 and "join yours with ','" in err


def test_a_failing_setup_line_stops_the_job_with_one_message(tmp_path):
    spec = JobSpec(
        "ddp/adamw", cluster=ClusterSettings(setup=["true", "no_such_activate_command_xyz", "echo SETUP-CONTINUED"])
    )
    script = tmp_path / "job.sh"
    script.write_text("\n".join(["#!/bin/bash", *preamble(spec), "echo TRAINING-STARTED", ""]))
    r = run_watched(["bash", str(script)], env={**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert r.returncode == 3
    assert "muloco: the cluster setup failed (exit 127) at: no_such_activate_command_xyz" in r.stderr
    assert "SETUP-CONTINUED" not in r.stdout and "TRAINING-STARTED" not in r.stdout
    ok = JobSpec("ddp/adamw", cluster=ClusterSettings(setup=["true"]))
    script.write_text("\n".join(["#!/bin/bash", *preamble(ok), "false", "echo TRAINING-STARTED", ""]))
    r = run_watched(["bash", str(script)], env={**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert r.returncode == 0 and "TRAINING-STARTED" in r.stdout  # the trap ends with the setup


def test_the_lighthouse_dependency_joins_the_users_own(slurm, tmp_path):
    """submit_scripts on the real SLURM: the held script is released with the user's dependency
    and ``after:<lighthouse>`` together (it used to lose the user's)."""
    env = {**os.environ, **slurm.env}
    blocker = (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--hold",
                "--wrap",
                "sleep 60",
                "--time",
                "2",
                "--output",
                str(tmp_path / "blocker.out"),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    header = [
        "#SBATCH --time=2",
        f"#SBATCH --output={sbatch_value('output', str(tmp_path / '%x-%j.out'))}",
        f"#SBATCH --dependency=afterok:{blocker}",
    ]  # neither can start (or end) while we look
    try:
        ids = submit_scripts(
            [
                Script(
                    "groups.sh",
                    "\n".join(["#!/bin/bash", *header, "true", ""]),
                    after="@lighthouse.sh",
                    dependency=f"afterok:{blocker}",
                ),
                Script("lighthouse.sh", "\n".join(["#!/bin/bash", *header, "true", ""])),
            ],
            str(tmp_path),
            env=env,
        )
        deps = subprocess.run(
            ["squeue", "-h", "-j", ids["groups.sh"], "-o", "%E"], capture_output=True, text=True, env=env
        ).stdout.strip()
        assert f"afterok:{blocker}" in deps and f":{ids['lighthouse.sh']}" in deps, deps
    finally:
        slurm.cancel({blocker, *locals().get("ids", {}).values()})


def _nodes(*specs):
    return [NodeInfo("p", name, cpus, gpus, mem, state, 60) for name, cpus, gpus, mem, state in specs]


def test_a_mixed_partition_offers_its_gpu_nodes_and_counts_only_those():
    nodes = _nodes(
        ("cpu1", 64, 0, 256_000, "idle"), ("gpu1", 96, 8, 1_000_000, "mix"), ("gpu2", 96, 8, 1_000_000, "idle")
    )
    part = resolve_partition(ClusterSettings(partition="p"), nodes, None)
    assert (part.gpus_per_node, part.cpus_per_node, part.nodes) == (8, 96, 3)  # it was min: 0 GPUs
    check_request(part, nodes=2, gpus_per_node=8, cpus_per_node=96, mem="900G", time="60")
    with pytest.raises(ClusterError, match="needs 3 node\\(s\\) but partition 'p' has 2 that hold"):
        check_request(part, nodes=3, gpus_per_node=8, cpus_per_node=96)
    check_request(part, nodes=3, gpus_per_node=0, cpus_per_node=64)  # CPU jobs may use all three
    with pytest.raises(ClusterError, match="no default partition: set --partition .*\\(partitions: p\\)"):
        resolve_partition(ClusterSettings(), nodes, None)  # none set and the cluster marks none


def test_down_nodes_warn_instead_of_refusing_and_limits_are_checked():
    nodes = _nodes(
        ("a", 8, 0, 16_000, "idle"),
        ("b", 8, 0, 16_000, "drain"),
        ("c", 8, 0, 16_000, "down*"),
        ("d", 8, 0, 16_000, "idle*"),
    )
    part = resolve_partition(ClusterSettings(partition="p"), nodes, None)
    said = []
    check_request(part, nodes=2, gpus_per_node=0, cpus_per_node=8, warn=said.append)  # SLURM queues it
    assert said == [
        "partition 'p' has 1 node(s) up that hold the request (3 down or drained); the job waits "
        "in the queue until 2 are back"
    ]
    with pytest.raises(ClusterError, match="needs 5 node"):
        check_request(part, nodes=5, gpus_per_node=0, cpus_per_node=8)
    with pytest.raises(ClusterError, match="--time 2:00:00 is more than partition 'p''s MaxTime of 60 minutes"):
        check_request(part, nodes=1, gpus_per_node=0, cpus_per_node=8, time="2:00:00")
    with pytest.raises(ClusterError, match="--mem 32G is more than the 16000 MB"):
        check_request(part, nodes=1, gpus_per_node=0, cpus_per_node=8, mem="32G")
    check_request(part, nodes=1, gpus_per_node=0, cpus_per_node=8, mem="0")  # 0: all of a node's memory


def test_a_dry_run_does_not_wait_for_a_silent_sinfo(capsys, monkeypatch, tmp_path):
    """A controller that is down (or no slurm.conf) can leave sinfo retrying for minutes: a dry run
    gives up after its short timeout, says so, and prints the job."""
    import muloco.launch.slurm.jobs as slurm_module

    _fake_sinfo(monkeypatch, tmp_path, "exec sleep 600")
    monkeypatch.setattr(slurm_module, "DRY_RUN_SINFO_TIMEOUT_S", 0.5)
    code, out, err = _dry_run(
        capsys, "ddp", "--config", "ddp/adamw", "--gpus-per-node", "0", "--cpus-per-node", "1", "--dry-run"
    )
    assert code == 0 and "sinfo did not answer in 0.5 s" in err and "#SBATCH --nodes=1" in out


def test_a_gpu_gres_replaces_gpus_per_node_and_mem_0_is_kept(capsys, gpu_cluster):
    code, out, err = _dry_run(
        capsys,
        "array",
        "--config",
        "diloco/muloco",
        "--replicas",
        "4",
        "--dry-run",
        "--gpus-per-node",
        "8",
        "--gpus-per-replica",
        "2",
        "--cpus-per-node",
        "96",
        "--mem",
        "0",
        "--gres",
        "gpu:h100:2",
    )
    assert code == 0, err
    groups = _sbatch_lines(out.split("lighthouse.sh (dry run")[0])
    assert '#SBATCH --mem="0"' in groups and '#SBATCH --gres="gpu:h100:2"' in groups
    assert not [line for line in groups if "--gpus-per-node" in line]


def test_the_lighthouse_job_takes_its_own_partition_qos_and_time_checked_against_sinfo(capsys, monkeypatch, tmp_path):
    """A GPU cluster with a CPU partition: the groups go to the GPU partition, the lighthouse (one
    CPU) to the CPU one with its own QOS and a longer limit; a lighthouse partition that does not
    exist, or whose MaxTime is shorter than asked, is one clear error before anything is written."""
    _fake_sinfo(
        monkeypatch,
        tmp_path,
        'case " $* " in *" -N "*) echo "gpu*|n1|96|gpu:h100:8|1000000|idle|2-00:00:00"; '
        'echo "cpu|c1|32|(null)|64000|idle|7-00:00:00";; *) printf "gpu*\\ncpu\\n";; esac',
    )
    base = [
        "array",
        "--config",
        "diloco/muloco",
        "--replicas",
        "2",
        "--dry-run",
        "--gpus-per-node",
        "8",
        "--cpus-per-node",
        "96",
        "--time",
        "1-00:00:00",
        "--qos",
        "high",
    ]
    code, out, err = _dry_run(
        capsys, *base, "--lighthouse-partition", "cpu", "--lighthouse-qos", "low", "--lighthouse-time", "3-00:00:00"
    )
    assert code == 0, err
    groups, lighthouse = (_sbatch_lines(part) for part in out.split("lighthouse.sh (dry run"))
    assert {'#SBATCH --partition="gpu"', '#SBATCH --qos="high"', '#SBATCH --time="1-00:00:00"'} <= set(groups)
    assert {'#SBATCH --partition="cpu"', '#SBATCH --qos="low"', '#SBATCH --time="3-00:00:00"'} <= set(lighthouse)
    assert not [line for line in lighthouse if "gpu" in line.lower()]
    code, _, err = _dry_run(capsys, *base, "--lighthouse-partition", "cpu")  # the groups' QOS and time
    assert code == 0, err
    code, _, err = _dry_run(capsys, *base, "--lighthouse-partition", "nope")
    assert code == 2 and "unknown partition 'nope'" in err
    code, _, err = _dry_run(capsys, *base, "--lighthouse-partition", "cpu", "--lighthouse-time", "8-00:00:00")
    assert code == 2 and "MaxTime" in err, err
    code, _, err = _dry_run(capsys, *base, "--lighthouse-time", "soon")
    assert code == 2 and "lighthouse_time 'soon' is not a SLURM time" in err


def test_a_dry_run_that_cannot_see_the_cluster_needs_the_node_shape(capsys, monkeypatch, tmp_path):
    """Without sinfo's answer and without --gpus-per-node the dry run refuses (one message naming
    the fix) instead of writing a CPU-only job for a GPU cluster; told only the GPUs, it writes
    them and leaves the CPUs to SLURM (no --cpus-per-task=1 guess)."""
    _fake_sinfo(monkeypatch, tmp_path, "echo 'sinfo: fatal: Could not establish a configuration source' >&2; exit 1")
    monkeypatch.setenv("MULOCO_CLUSTER_FILE", str(tmp_path / "none.toml"))
    code, out, err = _dry_run(capsys, "groups", "--config", "diloco/muloco", "--replicas", "8", "--dry-run")
    assert code == 2 and out == ""
    assert "Could not establish a configuration source" in err and "--gpus-per-node N" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = _dry_run(
        capsys, "ddp", "--config", "ddp/adamw", "--nodes", "2", "--gpus-per-node", "8", "--dry-run"
    )
    assert code == 0, err
    assert "nodes of 8 GPUs and SLURM's default CPUs, as given" in err
    lines = _sbatch_lines(out)
    assert "#SBATCH --gpus-per-node=8" in lines and not [line for line in lines if "--cpus-per-task" in line]
    assert "--nproc-per-node 8" in out


def test_a_controller_that_is_down_fails_at_once(capsys, monkeypatch, tmp_path):
    """slurm.conf names a controller that refuses connections: one message naming it, without
    waiting for an sinfo that would retry for minutes (this one never answers)."""
    import socket

    with socket.socket() as spare:  # a port nothing listens on once closed
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=x\nSlurmctldHost=head(127.0.0.1)  # the controller\nSlurmctldPort={port}\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    _fake_sinfo(monkeypatch, tmp_path, "exec sleep 600")
    code, out, err = _dry_run(capsys, "ddp", "--config", "ddp/adamw", "--dry-run")
    assert code == 2 and out == ""
    assert f"slurmctld does not answer at 127.0.0.1:{port}" in err and str(conf) in err
    assert "sinfo did not answer" not in err


@pytest.mark.parametrize("value", ["eth0 ib0", "eth0;reboot", "ib0,"])
def test_a_socket_interface_that_is_not_a_list_of_names_is_refused(capsys, value):
    code, out, err = _dry_run(
        capsys,
        "ddp",
        "--config",
        "ddp/adamw",
        "--gpus-per-node",
        "0",
        "--cpus-per-node",
        "1",
        "--socket-ifname",
        value,
        "--dry-run",
    )
    assert code == 2 and out == "" and f"socket_ifname {value!r} is not a list of network interfaces" in err


def test_an_nccl_exclusion_is_not_handed_to_gloo(capsys):
    code, out, err = _dry_run(
        capsys,
        "ddp",
        "--config",
        "ddp/adamw",
        "--gpus-per-node",
        "0",
        "--cpus-per-node",
        "1",
        "--socket-ifname",
        "^docker,lo",
        "--dry-run",
    )
    assert code == 0, err
    assert "export NCCL_SOCKET_IFNAME='^docker,lo'" in out and "GLOO_SOCKET_IFNAME" not in out
