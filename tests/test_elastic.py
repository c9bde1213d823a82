"""Surviving a lost rank: ``shoal train --checkpoint-every`` under ``shoal run --max-restarts``.

A rank killed with SIGKILL in the middle of training (``SHOAL_FAULT_AT``) stops the others; the
restarted job resumes every rank from the latest checkpoint and ends where an uninterrupted run
ends, bit for bit. A world that comes back smaller (one process) resumes from the same checkpoints.
"""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shoal import checkpoint

TINY = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set", "block_size=16"]
TRAIN = ["train", "gpt", "--devices", "2", "--plan", "dp", "--steps", "6", "--batch", "4", "--sample", "0",
         "--threads", "1", "--no-progress", "--every", "1", "--checkpoint-every", "2", *TINY]


def shoal(args, run_dir: Path, fault: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m shoal ARGS`` writing its losses and checkpoints under ``run_dir``; ``fault``
    (``step:rank``) kills that rank in the first attempt."""
    env = {"SHOAL_TIMEOUT": "30"} | ({"SHOAL_FAULT_AT": fault} if fault else {})
    cmd = [sys.executable, "-m", "shoal", *args, *TRAIN, "--checkpoint-dir", str(run_dir / "ck"),
           "--out", str(run_dir / "out")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ | env)


def two_processes(max_restarts: int) -> list[str]:
    return ["run", "-n", "2", "--max-restarts", str(max_restarts), "-m", "shoal"]


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "out" / "losses.json").read_text())["losses"]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of the run's latest checkpoint, exported as one plain state dict."""
    last = checkpoint.latest(run_dir / "ck")
    assert last is not None and last.name == "step-6", last
    return load_file(checkpoint.export(last, run_dir / "final.safetensors", "model"))


def log(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr  # whole: ranks retrying a dead attempt's address log C++ traces


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("uninterrupted")
    p = shoal(two_processes(0), d)
    assert p.returncode == 0, log(p)
    assert "resumed" not in p.stdout
    return d


@pytest.mark.multiprocess
def test_a_killed_rank_restarts_and_ends_where_an_uninterrupted_run_ends(uninterrupted, tmp_path):
    p = shoal(two_processes(1), tmp_path, fault="3:1")
    out = log(p)
    assert p.returncode == 0, out
    assert "exitcode: -9" in out and "local_rank: 1" in out, out  # rank 1 did die, and torchrun named it
    assert "resumed from" in p.stdout and "step-2: step 2 of 6" in p.stdout, out
    assert losses(tmp_path) == losses(uninterrupted)
    want, got = final_params(uninterrupted), final_params(tmp_path)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.multiprocess
def test_a_world_that_comes_back_smaller_resumes_on_one_process(uninterrupted, tmp_path):
    lost = shoal(two_processes(0), tmp_path, fault="3:1")
    assert lost.returncode != 0 and "exitcode: -9" in log(lost), log(lost)
    assert checkpoint.latest(tmp_path / "ck").name == "step-2"
    one = shoal([], tmp_path)  # the same command on one process of two devices
    assert one.returncode == 0, log(one)
    assert "resumed from" in one.stdout and "step-2: step 2 of 6" in one.stdout, log(one)
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(uninterrupted)),
                               rtol=1e-5, atol=0)
    want, got = final_params(uninterrupted), final_params(tmp_path)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def elastic_node(run_dir: Path, port: int, fault: str | None = None) -> subprocess.Popen:
    """One node of an elastic world (``--nnodes 1:2``, one process of one device) joining the
    rendezvous at ``port``, whose store the test hosts (as an etcd or a head node would: it
    outlives any node); ``fault`` kills a rank's node whole in the first attempt. Heartbeats every
    second, a node silent for three is dead (with two, torch's agent can miss its own first beat
    and drop itself as dead)."""
    train = [a if a != "2" or TRAIN[i - 1] != "--devices" else "auto" for i, a in enumerate(TRAIN)]
    cmd = [sys.executable, "-m", "shoal", "run", "-n", "1", "--nnodes", "1:2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink", "--max-restarts", "1",
           "--rdzv-conf", "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
           "-m", "shoal", *train, "--checkpoint-dir", str(run_dir / "ck"), "--out", str(run_dir / "out")]
    env = os.environ | {"SHOAL_TIMEOUT": "30"} | ({"SHOAL_FAULT_AT": fault} if fault else {})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.multiprocess
def test_a_node_lost_under_nnodes_min_max_resumes_on_the_survivor(uninterrupted, tmp_path):
    import torch.distributed as dist

    rdzv = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    nodes = [elastic_node(tmp_path, rdzv.port, "3:1:node")]
    time.sleep(0.5)  # node 0 joins first; its agent's process is older, so its worker is rank 0
    nodes.append(elastic_node(tmp_path, rdzv.port, "3:1:node"))
    try:
        outs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    survivor, lost = (0, 1) if nodes[0].returncode == 0 else (1, 0)
    out = outs[survivor][-6000:]
    assert nodes[survivor].returncode == 0 and nodes[lost].returncode != 0, out + outs[lost][-3000:]
    assert "rank 1 stopped answering" in out, out  # the survivor named the lost rank
    assert "resumed from" in out and "step-2: step 2 of 6" in out, out
    assert "plan dp on mesh 1 (1 virtual CPU device)" in out, out  # the world came back with one process
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(uninterrupted)),
                               rtol=1e-5, atol=0)
    want, got = final_params(uninterrupted), final_params(tmp_path)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_a_node_that_joins_under_nnodes_min_max_restarts_the_world_larger(uninterrupted, tmp_path):
    """torchrun restarts the workers for a change of membership without counting a restart: the
    new attempt must still not read the keys the one-process attempt left."""
    import torch.distributed as dist

    rdzv = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    nodes = [elastic_node(tmp_path, rdzv.port, "3:0:hold")]  # trains alone, holds at step 3 until joined
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest(tmp_path / "ck") is None:
            assert time.monotonic() < deadline and nodes[0].poll() is None, nodes[0].communicate()[0][-4000:]
            time.sleep(0.2)
        nodes.append(elastic_node(tmp_path, rdzv.port))
        outs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    out = outs[0][-6000:]
    assert [n.returncode for n in nodes] == [0, 0], out + outs[1][-3000:]
    assert "plan dp on mesh 1 (1 virtual CPU device)" in out, out  # it began alone
    assert "plan dp on mesh 2 (2 processes x 1 virtual CPU device each)" in out, out  # and ended with two
    assert "resumed from" in out and "step-2: step 2 of 6" in out, out
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(uninterrupted)),
                               rtol=1e-5, atol=0)
    want, got = final_params(uninterrupted), final_params(tmp_path)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
