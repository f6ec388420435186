"""Every benchmark runs: ``python bench/X.py --smoke`` for each script in bench/.

The parameters are the files themselves, so a new bench without ``--smoke`` (or without
its table registered in TABLES) fails here. A module of bench/ that is a library, not a
script, is named in LIBRARIES with the reason, and checked to have no ``__main__`` block.
What a smoke run prints is measured on whatever machine runs it, so no figure is checked
against a value: the run must exit 0 and print its tables (their header and rows with
numbers in them). The benches that ``gpu_suite.py --smoke`` runs whole as its parts
(RUN_BY_GPU_SUITE) are checked in its parts' logs, not run twice.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Watched

from muloco.launch.netns import unavailable as netns_unavailable

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted((REPO / "bench").glob("*.py"))
HANG_S = 420
"""A smoke run that prints nothing for this long hangs (the slowest takes about a minute on 2 free cores)."""

LIBRARIES = {
    "local_run.py": "one whole local job to completion, for the benches that measure jobs",
    "machine.py": "the load average and the SIGTERM handling the benches share",
}

NUM = r"[\d,]+(?:\.\d+)?"
TABLES = {
    "live_bytes.py": [
        r"case +expected B +counted B +ok",
        rf"new tensor \(x \* 2\) +{NUM} +{NUM} +yes",
        r"view \(x\.view\(-1\)\[1:\]\) +0 +0 +yes",
    ],
    "codecs.py": [
        r"codec +kernels +bits/param +rel err +clone ms +encode ms",
        rf"dense\(float32\) +eager +32\.000 +{NUM} +{NUM} +{NUM} +{NUM}x",
        rf"quantize\(statistical, 2b.*eager +2\.0\d+ +{NUM}",
        r"codec +K +ring MB +allgather MB",
        rf"2-bit statistical +16 +{NUM} +{NUM}",
    ],
    "diffusion.py": [
        r"objective +tok/s \(median\) +ratio to ar",
        rf"(?m)^mdlm +{NUM} +{NUM}",
        rf"(?m)^flex +{NUM}",
        rf"flex / sdpa = {NUM}",
        r"levels/batch +NELBO mean",
        rf"(?m)^ +32 +{NUM} +{NUM}",
    ],
    "generate.py": [
        r"length +block +batch +reference tok/s +sampler tok/s +ratio +same +threshold x +threshold agree"
        r" +prefix x +prefix agree +prefix\+threshold x",
        rf"(?m)^ +16 +8 +1 +{NUM} +{NUM} +{NUM} +yes +{NUM} +{NUM}% +{NUM} +{NUM}% +{NUM} +{NUM}%",
        rf"(?m)^ +8 +8 +2 +{NUM} +{NUM} +{NUM} +yes",
    ],
    "exchange_memory.py": [
        r"codec +strategy +this checkout",
        rf"quantize +reduce_scatter +{NUM} MB +{NUM}x Δ",
        rf"topk +allgather +{NUM} MB",
    ],
    "gpu_suite.py": [
        r"(?m)^part +case +figures +\[status\]",
        rf"(?m)^throughput +416m ar, compile eager.*ours {NUM} tok/s.*ratio {NUM} +\[ok\]",
        rf"(?m)^throughput +158m mdlm, no compile.*ratio {NUM} +\[ok\]",
        rf"(?m)^sync +θ_g on device.*{NUM} ms per sync \(quorum {NUM}.*\[ok\]",
        r"(?m)^sync +θ_g on cpu.*\[skipped: needs CUDA",
        rf"(?m)^memory +sync buffers, θ_g on device +peak {NUM} MB.*\[ok\]",
        rf"(?m)^codecs +quantize\(statistical, 2b.*eager.*encode {NUM} ms = {NUM}x clone.*\[ok\]",
        rf"(?m)^generate +length 16, block 8, batch 1.*sampler {NUM} tok/s = {NUM}x LLaDA's loop \(same "
        rf"tokens\); threshold {NUM}x.*prefix {NUM}x.*\[ok\]",
        rf"(?m)^diffusion +mdlm / ar \(target >= 0\.97\), llama3-w64-d2-h2.* = {NUM} +\[ok\]",
        rf"(?m)^diffusion +document mask, forward only.*flex {NUM} / sdpa {NUM} tok/s = {NUM} \(flex eager\)",
    ],
    "round_modes.py": [
        r"case +mode +seed +wall s +final loss +job tok/s +steps per group +to lockstep loss s",
        rf"(?m)^2x2 +lockstep +0 +{NUM} +{NUM}",
        rf"(?m)^2x2 +deadline +0 +{NUM} +{NUM}",
        r"2x2 deadline / lockstep wall-clock to lockstep's final loss",
    ],
    "gpu_throughput.py": [
        r"run# +side +tokens/s",
        rf"(?m)^416m compile off ours: {NUM} tok/s, stock {NUM}: ratio",
        rf"θ_g on device +0\.4M +{NUM} +{NUM}",
        rf"sync share, θ_g on the training device: {NUM}%.*{NUM} ms per sync, peak {NUM} MB",
    ],
    "link_planner.py": [
        r"config +link \(emulated\) +projected s +measured s +link part s +syncs +ratio",
        rf"(?m)^diloco/diloco +20 Mbps +{NUM} +{NUM} +{NUM} +2 +{NUM}  (yes|no)$",
    ],
    "muon.py": [
        r"NS batch \(b x m x n\) +GFLOP",
        r"optimizer +step\(\) ms +train step ms",
        rf"(?m)^ +Muon +{NUM} +{NUM} +{NUM}%",
        r"flavor +params +NS eff",
        rf"llama3-w64-d2-h2 +0\.36M +{NUM} +{NUM}x",
    ],
    "startup.py": [
        r"command +seconds +x torch +target +met",
        rf"(?m)^import torch +{NUM} +1\.00",
        rf"(?m)^muloco --help +{NUM} +{NUM} +1x +(yes|no)$",
        rf"(?m)^map \(sizing table\) +{NUM} +{NUM} +1x",
    ],
    "sync_overhead.py": [
        rf"(?m)^ +1 +0 +{NUM} +{NUM} +{NUM} +{NUM}%",
        rf"llama3-w64-d2-h2 +362,816 +{NUM}",
        rf"(?m)^  diloco/diloco +0\.4M +{NUM} +{NUM}",
        rf"sync share at H=2, K=2.*: {NUM}%",
        rf"sync time by model size .*0\.4M: {NUM} ms",
    ],
    "unequal_groups.py": [
        r"run +wall s +job tok/s +group +steps s +syncs s +median step s",
        rf"(?m)^equal +{NUM} +{NUM} +0 +{NUM} +{NUM} +{NUM}$",
        rf"(?m)^group 1 2x slower +{NUM} +{NUM} +0 +{NUM}",
        rf"the waiting it causes is -?{NUM}% of all groups' time \(measured\); the planner's formula",
        rf"own pace would train {NUM}x the lockstep job's",
        r"θ_g after the last sync bit for bit the equal run's: yes",
    ],
    "block_sampler.py": [
        r"length +whole canvas tok/s +block cache tok/s +speed-up +same text",
        rf"(?m)^ +64 +{NUM} +{NUM} +{NUM}x +yes$",
    ],
    "conversion.py": [
        r"validation NELBO \(nats/token\), mean over seeds",
        rf"(?m)^scratch +{NUM} ±{NUM}",
        rf"(?m)^block +{NUM} ±{NUM}",
        r"scratch's final NELBO .* first step reaching it",
        r"run +val loss \(mean ± half range\) +bytes/sync +bytes ratio +loss gap",
        rf"(?m)^lora-adamw +{NUM} ±{NUM} +{NUM} +{NUM}x",
    ],
    "partition_drills.py": [
        r"drill +K +rounds +agree +committed/rolled back/missed per group +twice +recover s",
        rf"(?m)^k2-cut-3s +2 +lockstep +yes +2/0/0 2/0/0 +0 +{NUM} +{NUM}$",
    ],
    "trainer_overhead.py": [
        r"run# +side +tokens/s",
        rf"(?m)^ +1 +ours +{NUM} +{NUM}",
        rf"(?m)^ +2 +stock +{NUM}",
        rf"ratio ours/stock = {NUM}",
    ],
}
"""Per bench, what its smoke output must show: each pattern is searched for in the output."""

RUN_BY_GPU_SUITE = {"gpu_throughput.py": ("throughput", "sync"), "generate.py": ("generate",)}
"""Benches whose whole ``--smoke`` run ``bench/gpu_suite.py --smoke`` makes as its parts (with the
parts' arguments, which ``--smoke`` scales down): their tables are looked for in those parts' logs
instead of in a second run of the same thing (about 70 s of the suite on two cores)."""


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def gpu_suite_smoke(tmp_path_factory) -> tuple[int | None, str, str, Path]:
    """``bench/gpu_suite.py --smoke``, once for its own test and the benches it runs as parts:
    exit status, stdout, stderr and the folder of the parts' logs."""
    log_dir = tmp_path_factory.mktemp("gpu_suite")
    return (*_run_smoke(REPO / "bench" / "gpu_suite.py", "--log-dir", str(log_dir)), log_dir)


def _smoke_output(bench: Path, request) -> tuple[int | None, str, str]:
    """What ``bench --smoke`` printed: from its own run, or from the gpu_suite parts that ran it."""
    if bench.name == "gpu_suite.py":
        return request.getfixturevalue("gpu_suite_smoke")[:3]
    if bench.name not in RUN_BY_GPU_SUITE:
        return _run_smoke(bench)
    code, out, err, log_dir = request.getfixturevalue("gpu_suite_smoke")
    parts = RUN_BY_GPU_SUITE[bench.name]
    for part in parts:
        header = next((line for line in out.splitlines() if line.startswith(f"== {part}: ")), "")
        assert f"bench/{bench.name} " in header, f"gpu_suite --smoke ran no part {part!r} of bench/{bench.name}:\n{out}"
    return code, "".join((log_dir / f"{part}.log").read_text() for part in parts), err


@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize("bench", BENCHES, ids=lambda path: path.name)
def test_bench_smoke(bench: Path, request):
    if bench.name in LIBRARIES:
        assert "__main__" not in bench.read_text(), f"{bench.name} is listed as a library but runs as a script"
        return
    assert bench.name in TABLES, (
        f"bench/{bench.name} has no expected table here: add what its --smoke run "
        "prints to TABLES (or, if it is a library, to LIBRARIES with the reason)"
    )
    code, out, err = _smoke_output(bench, request)
    tail = f"--- stdout tail ---\n{out[-4000:]}\n--- stderr tail ---\n{err[-4000:]}"
    assert code == 0, f"bench/{bench.name} --smoke exited {code}\n{tail}"
    if bench.name == "partition_drills.py" and netns_unavailable() is not None:  # not root, or no iproute2
        assert f"partition drills skipped: {netns_unavailable()}" in out, tail
        return
    missing = [p for p in TABLES[bench.name] if not re.search(p, out)]
    assert not missing, f"bench/{bench.name} --smoke did not print {missing}\n{tail}"


def _run_smoke(bench: Path, *args: str) -> tuple[int | None, str, str]:
    """Exit status, stdout and stderr of ``bench --smoke ARGS``. A run that prints nothing for HANG_S
    seconds is hung: SIGTERM first (the benches stop the jobs and parts they started in sessions
    of their own, which a SIGKILL of the bench alone would leave running), then SIGKILL."""
    proc = subprocess.Popen(
        [sys.executable, str(bench), "--smoke", *args],
        cwd=REPO,
        env=_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    followed = Watched(proc, HANG_S)
    if not followed.finished():
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ran = followed.result()
        pytest.fail(
            f"bench/{bench.name} --smoke printed nothing for {HANG_S} s (a hang)\n{ran.stdout[-4000:]}\n"
            f"{ran.stderr[-4000:]}"
        )
    ran = followed.result()
    return proc.returncode, ran.stdout, ran.stderr
