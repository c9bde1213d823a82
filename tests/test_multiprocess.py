"""Multi-process runs under `shoal run` (torchrun, gloo): the same results as one process."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent / "multiproc"


def shoal_run(nproc: int, per_process: int, script: str, timeout: float = 240, args=()):
    cmd = [sys.executable, "-m", "shoal.launch", "-n", str(nproc), "--devices-per-process", str(per_process),
           str(HERE / script), *args]
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
def test_a_killed_rank_stops_the_others_and_is_named():
    code, out, elapsed = shoal_run(2, 1, "fail_worker.py", timeout=120, args=("kill",))
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "rank      : 1" in out or "rank: 1" in out, out[-3000:]  # torchrun's root cause names it
    assert "Signal 9" in out or "SIGKILL" in out or "-9" in out, out[-3000:]


@pytest.mark.multiprocess
def test_debug_mode_reports_diverging_processes(monkeypatch):
    """SHOAL_DEBUG=1 catches values that differ between the ranks where they must not: a plain tensor
    meeting an op, a plain tensor made global (to_global), pieces along Broadcast axes (from_local)."""
    monkeypatch.setenv("SHOAL_DEBUG", "1")
    code, out, elapsed = shoal_run(2, 2, "debug_worker.py", timeout=120)
    assert code == 0 and "NOT DETECTED" not in out, out[-3000:]
    for r in range(2):
        assert f"DEBUG OK rank {r}" in out, out[-3000:]
        for what in ("op", "to_global", "from_local"):
            assert f"CAUGHT {what} on rank {r}: shoal (SHOAL_DEBUG): the processes diverged at op #" in out, out[-3000:]
    assert "(to_global of a plain tensor): the plain tensor is the global value" in out
    assert "(from_local): devices [0, 2] of" in out and "(sbp [B, S(0)])" in out
    assert "device 2 (rank 1): ('plain', (2, 3), 'torch.float32'," in out
    assert elapsed < 60


@pytest.mark.multiprocess
def test_readme_examples_run_under_shoal_run(tmp_path, monkeypatch):
    """The Quickstart and the example of "Many processes", one device per process as under
    ``torchrun --nproc-per-node 4``, with SHOAL_DEBUG=1: every rank draws the same values (seeded),
    to_local() is a dict there too, and the global values are single-device torch's."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = [re.search(r"```python\n(.*?)```", text.split(f"## {s}\n", 1)[1], re.S)[1]
            for s in ("Quickstart", "Many processes")]
    (tmp_path / "readme.py").write_text("".join(code))
    monkeypatch.setenv("SHOAL_DEBUG", "1")
    code, out, _ = shoal_run(4, 1, str(tmp_path / "readme.py"))
    assert code == 0, out[-4000:]
    assert "False" not in out and out.count("True") == 4 * 2, out[-4000:]  # two per rank


@pytest.mark.multiprocess
def test_shoal_train_gpt_under_shoal_run_matches_one_process(tmp_path):
    tiny = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set", "block_size=16"]
    args = ["train", "gpt", "--devices", "2", "--plan", "dp", "--steps", "3", "--batch", "4", "--sample", "0",
            "--threads", "1", "--no-progress", *tiny]
    one = subprocess.run([sys.executable, "-m", "shoal", *args, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "shoal", "run", "-n", "2", "-m", "shoal", *args,
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    a = json.loads((tmp_path / "one" / "losses.json").read_text())
    b = json.loads((tmp_path / "two" / "losses.json").read_text())
    la, lb = (x["losses"] if isinstance(x, dict) else x for x in (a, b))
    assert len(la) == 3
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_compiled_step_across_processes_matches_eager(tmp_path):
    code, out, _ = shoal_run(2, 2, "graph_worker.py", args=(str(tmp_path),))
    assert code == 0, out[-4000:]
    for r in range(2):
        assert f"OK rank {r} of 2 x 2 devices" in out


@pytest.mark.multiprocess
def test_a_mesh_makes_no_process_group_until_a_collective_needs_it():
    code, out, _ = shoal_run(4, 1, "groups_worker.py", timeout=120)
    assert code == 0, out[-4000:]
    for r, groups in enumerate(["[(0, 1, 3)]", "[(0, 1, 3), (1, 2)]", "[(1, 2)]", "[(0, 1, 3)]"]):
        assert f"GROUPS OK rank {r}: {groups}" in out, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_process", [1, 4])
def test_pipeline_stages_on_two_processes_equal_one_device(per_process):
    """One stage per process: activations and their gradients cross by point-to-point sends, in an
    order that cannot deadlock (GPipe's all-forwards-first and interleaved's two visits included);
    with 4 devices per process, pipeline x data x tensor parallel (pp=2, dp=2, tp=2), and a GPT by
    ``auto.Parallel.to_plan`` whose activations cross replicated over tp (sent 1/tp, gathered on
    arrival) or split on the sequence (sp)."""
    code, out, _ = shoal_run(2, per_process, "pipeline_worker.py", timeout=240)
    assert code == 0, out[-4000:]
    for r in range(2):
        assert f"OK rank {r} of 2 x {per_process} devices" in out, out[-4000:]
        if per_process == 4:  # and a GPT laid out by auto's plans, with and without sequence parallelism
            assert f"gpt sp=False: rank {r} ok" in out and f"gpt sp=True: rank {r} ok" in out, out[-4000:]
