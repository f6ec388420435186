"""Sweep definitions, run names, the manifest and cluster settings, without a cluster."""

from __future__ import annotations

import runpy
from types import SimpleNamespace

import pytest
from conftest import REPO

from muloco.launch.slurm.cluster import ClusterError, ClusterSettings, _gpus, load_cluster_settings
from muloco.launch.slurm.commands import combined_state, states_in
from muloco.launch.slurm.jobs import JobError, JobSpec
from muloco.launch.sweeps.sweep import grid, lr_grid, plan, render, same_shape
from muloco.runs.sweep_manifest import Entry, ManifestError, read_manifest, write_manifest

SWEEP_FILES = sorted((REPO / "jobs" / "sweeps").glob("*.py"))


def test_lr_grid_is_the_root_two_ladder_around_its_centre():
    center = 0.0224
    assert lr_grid(center, 3) == [
        pytest.approx(center / 2**0.5, rel=1e-3),
        center,
        pytest.approx(center * 2**0.5, rel=1e-3),
    ]
    assert len(lr_grid(center, 2)) == 2 and lr_grid(center, 1) == [center]


def test_grid_is_the_product_of_its_values_with_the_fixed_flags_on_every_run():
    runs = grid(
        "groups",
        "diloco/muloco",
        replicas=4,
        fixed={"--training.steps": 60},
        vary={"--optimizer.lr": [0.01, 0.02], "--outer.optimizer.lr": [0.7, 0.9, 1.0]},
    )
    assert len(runs) == 6
    assert all(r.overrides[:2] == ["--training.steps", "60"] and r.options == {"replicas": 4} for r in runs)
    pairs = {(r.overrides[3], r.overrides[5]) for r in runs}
    assert pairs == {(a, b) for a in ("0.01", "0.02") for b in ("0.7", "0.9", "1")}
    with pytest.raises(ValueError, match="unknown kind"):
        grid("mpi", "ddp/adamw")


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_shipped_sweep_plans_with_unique_readable_names(path, tmp_path):
    sweep = runpy.run_path(str(path))["SWEEP"]
    planned = plan(sweep, str(tmp_path), lambda c, o: JobSpec(c, o, ClusterSettings(gpus_per_node=8)), [])
    names = [p.entry.name for p in planned]
    assert len(set(names)) == len(names) == len(sweep.runs)
    for p in planned:
        cfg = p.job.trainer
        assert f"lr{cfg.optimizer.lr:g}" in p.entry.name and cfg.model.flavor.replace("llama3-", "") in p.entry.name
        if hasattr(cfg, "outer"):
            assert f"K{cfg.fault_tolerance.group_size}_H{cfg.outer.sync_every}" in p.entry.name
        assert cfg.dump_folder == str(tmp_path / p.entry.name) == p.entry.run_dir
    assert not list(tmp_path.iterdir()), "planning writes nothing"


def test_runs_of_one_shape_share_an_array_and_mixed_kinds_do_not(tmp_path):
    spec = lambda c, o: JobSpec(c, o, ClusterSettings(gpus_per_node=8))  # noqa: E731
    tiny = {"--model.flavor": "llama3-w64-d2-h2"}
    same = plan(runpy.run_path(str(REPO / "jobs/sweeps/tiny_cpu.py"))["SWEEP"], str(tmp_path), spec, [])
    assert same_shape(same)
    from muloco.launch.sweeps.sweep import Sweep

    mixed = Sweep(
        "m",
        grid("ddp", "ddp/adamw", nodes=1, fixed=tiny)
        + grid("groups", "diloco/muloco", replicas=2, fixed={**tiny, "--training.steps": 30}),
    )
    assert not same_shape(plan(mixed, str(tmp_path), spec, []))


def test_runs_with_different_k_are_not_one_array_and_spanning_runs_render_as_one(tmp_path):
    from muloco.launch.sweeps.sweep import Sweep

    spec = lambda c, o: JobSpec(c, o, ClusterSettings(gpus_per_node=8))  # noqa: E731
    fixed = {"--model.flavor": "llama3-w64-d2-h2", "--training.steps": 30}
    ks = Sweep(
        "k",
        grid("groups", "diloco/muloco", replicas=2, fixed=fixed)
        + grid("groups", "diloco/muloco", replicas=4, fixed=fixed),
    )
    assert not same_shape(plan(ks, str(tmp_path), spec, []))
    span = Sweep(
        "s",
        grid(
            "spanning",
            "diloco/muloco",
            replicas=2,
            nodes_per_replica=2,
            fixed=fixed,
            vary={"--optimizer.lr": [0.01, 0.02]},
        ),
    )
    planned = plan(span, str(tmp_path), spec, [])
    assert same_shape(planned)
    (submission,) = render(planned, span, str(tmp_path), SimpleNamespace(max_nodes=None, parallel=2))
    assert submission.array and submission.runs == planned
    text = submission.scripts[0].text
    assert "#SBATCH --nodes=4" in text and "--replicas 2" in text and "#SBATCH --array=0-1%2" in text


def test_a_run_larger_than_max_nodes_is_refused_instead_of_waiting_forever():
    from muloco.launch.sweeps.sweep import wait_for_nodes

    with pytest.raises(JobError, match="more than --max-nodes 2: it could never start"):
        wait_for_nodes(3, 2, 0.1, print)


def test_two_runs_with_one_name_are_refused(tmp_path):
    from muloco.launch.sweeps.sweep import Sweep

    twice = Sweep("d", grid("ddp", "ddp/adamw", nodes=1, vary={"--debug.seed": [1, 2]}))
    with pytest.raises(JobError, match="both named"):
        plan(twice, str(tmp_path), lambda c, o: JobSpec(c, o, ClusterSettings(gpus_per_node=0)), [])


def test_manifest_round_trips_and_a_broken_line_is_named(tmp_path):
    entries = {
        n: Entry(
            n,
            "ddp",
            "ddp/adamw",
            ["--optimizer.lr", "0.01"],
            {"nodes": 1},
            str(tmp_path / n),
            ["12_0", "15"],
            "COMPLETED",
        )
        for n in ("a", "b")
    }
    write_manifest(str(tmp_path), entries)
    assert read_manifest(str(tmp_path)) == entries
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.jsonl"], "written atomically, no temp left"
    entries["a"].job_files = {"groups.sh": "15", "lighthouse.sh": "16"}  # every job of a submission
    write_manifest(str(tmp_path), entries)
    assert read_manifest(str(tmp_path))["a"].job_files == {"groups.sh": "15", "lighthouse.sh": "16"}
    with open(tmp_path / "manifest.jsonl", "a") as f:  # a line of an older manifest, without job_files
        f.write(
            '{"name": "c", "kind": "ddp", "config": "ddp/adamw", "overrides": [], "options": {}, '
            '"run_dir": "c", "jobs": ["9"], "state": "NEW"}\n'
        )
    assert read_manifest(str(tmp_path))["c"].job_files == {}
    with open(tmp_path / "manifest.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ManifestError, match=r"manifest.jsonl:4 is not a manifest line"):
        read_manifest(str(tmp_path))


def test_gres_strings_give_the_gpu_count():
    assert _gpus("gpu:h100:8(S:0-1)") == 8
    assert _gpus("gpu:4,shard:2") == 4
    assert _gpus("(null)") == 0


def test_cluster_settings_precedence_and_type_errors(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('partition = "a"\ngpus_per_node = 4\n')
    s = load_cluster_settings({"partition": None}, f, {"MULOCO_SLURM_GPUS_PER_NODE": "2"})
    assert (s.partition, s.gpus_per_node) == ("a", 2)
    s = load_cluster_settings({"gpus_per_node": 0}, f, {"MULOCO_SLURM_GPUS_PER_NODE": "2"})
    assert s.gpus_per_node == 0
    with pytest.raises(ClusterError, match="gpus_per_node = 'eight' is not a valid"):
        load_cluster_settings({}, f, {"MULOCO_SLURM_GPUS_PER_NODE": "eight"})
    f.write_text("partition = \n")
    with pytest.raises(ClusterError, match="not valid TOML"):
        load_cluster_settings({}, f, {})


def test_paper_settings_split_the_batch_over_k_and_rescale_the_weight_decay():
    from muloco.launch.sweeps.sweep import paper_batch_and_decay
    from muloco.models.flavors import parse_flavor, steps_for_batch

    flavor = "llama3-w1024-d12-h8"
    flags = paper_batch_and_decay(flavor, "muon", 8)
    wd = parse_flavor(flavor).shape.weight_decay["muon"]
    ratio = steps_for_batch(flavor, 512, 2048) / steps_for_batch(flavor, 512, 2048)
    assert flags["--training.global_batch_size"] == 64
    assert flags["--optimizer.weight_decay"] == pytest.approx(wd * ratio / 8, rel=1e-5)
    with pytest.raises(ValueError, match="does not split"):
        paper_batch_and_decay(flavor, "muon", 3)


def test_an_array_jobs_state_covers_every_task():
    """scontrol answers an array job id with one record per task: the state is all of them (it
    was the first task's)."""
    two = (
        "JobId=41 ArrayJobId=40 ArrayTaskId=0 JobName=g\n   JobState=COMPLETED Reason=None\n\n"
        "JobId=42 ArrayJobId=40 ArrayTaskId=1 JobName=g\n   JobState=RUNNING Reason=None\n"
    )
    assert states_in(two) == ["COMPLETED", "RUNNING"] and combined_state(states_in(two)) == "RUNNING"
    assert combined_state(["COMPLETED", "FAILED"]) == "FAILED"
    assert combined_state(["COMPLETED", "COMPLETED"]) == "COMPLETED"
    assert combined_state(["PENDING", "COMPLETED"]) == "PENDING"
    assert combined_state(states_in("COMPLETED|\nTIMEOUT|\n")) == "TIMEOUT"  # sacct -P, one line per task
    assert combined_state([]) is None


def test_the_smoke_copy_asks_for_the_gpus_and_cpus_its_run_asks_for(tmp_path):
    """``--smoke-steps``: the short copy of the first run goes to the run's partition with the run's
    request. It was rebuilt without the placed partition and asked for no GPU (a CPU job of one
    rank on a GPU cluster)."""
    from muloco.launch.slurm.cluster import NodeInfo
    from muloco.launch.sweeps.sweep import Sweep, smoke_script

    nodes = [NodeInfo("gpu", f"n{i}", cpus=64, gpus=8) for i in range(2)]
    sweep = Sweep(
        "s",
        grid(
            "groups", "diloco/muloco", replicas=2, fixed={"--model.flavor": "llama3-w64-d2-h2", "--training.steps": 30}
        ),
    )
    (run,) = plan(sweep, str(tmp_path / "sweep"), lambda c, o: JobSpec(c, o, ClusterSettings()), [])
    run.job.place(nodes, "gpu")
    smoke, smoke_dir = smoke_script(run, 60, str(tmp_path / "sweep"))
    for text in (run.job.scripts()[0].text, smoke.text):
        assert "#SBATCH --gpus-per-node=8" in text and '#SBATCH --partition="gpu"' in text, text
        assert "#SBATCH --cpus-per-task=" in text
    assert "--training.steps 60" in smoke.text and smoke_dir in smoke.text


def test_the_smoke_copy_of_a_run_given_in_epochs_trains_the_smoke_steps(tmp_path):
    """A run whose length is ``--training.epochs`` would refuse the smoke's ``--training.steps``
    beside it (both set the length): the smoke copy leaves the epochs out."""
    from muloco.launch.sweeps.sweep import Sweep, smoke_script

    sweep = Sweep(
        "s",
        grid(
            "groups", "diloco/muloco", replicas=2, fixed={"--model.flavor": "llama3-w64-d2-h2", "--training.epochs": 2}
        ),
    )
    (run,) = plan(sweep, str(tmp_path / "sweep"), lambda c, o: JobSpec(c, o, ClusterSettings()), [])
    smoke, _ = smoke_script(run, 60, str(tmp_path / "sweep"))
    assert "--training.epochs 2" in run.job.scripts()[0].text
    assert "--training.epochs" not in smoke.text and "--training.steps 60" in smoke.text
