"""Multi-process runs under `shoal run` (torchrun, gloo): the same results as one process."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "multiproc"


def shoal_run(nproc: int, per_process: int, script: str, timeout: float = 240):
    cmd = [sys.executable, "-m", "shoal.launch", "-n", str(nproc), "--devices-per-process", str(per_process),
           str(HERE / script)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,per_process", [(2, 2), (4, 1)])
def test_core_and_models_match_single_process(nproc, per_process):
    code, out, _ = shoal_run(nproc, per_process, "worker.py")
    assert code == 0, out[-4000:]
    for r in range(nproc):
        assert f"OK rank {r} of {nproc} x {per_process} devices" in out


@pytest.mark.multiprocess
def test_a_failing_rank_stops_the_others_and_is_named():
    code, out, elapsed = shoal_run(2, 1, "fail_worker.py", timeout=120)
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "injected failure" in out
    assert "rank: 1" in out or "rank 1 failed" in out, out[-3000:]


@pytest.mark.multiprocess
def test_debug_mode_reports_diverging_processes(monkeypatch):
    monkeypatch.setenv("SHOAL_DEBUG", "1")
    code, out, elapsed = shoal_run(2, 1, "debug_worker.py", timeout=120)
    assert code != 0 and "NOT DETECTED" not in out
    assert "the processes diverged at op" in out and "plain" in out, out[-3000:]
    assert elapsed < 60
