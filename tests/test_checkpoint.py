"""Sharded checkpoints (``shoal.checkpoint``): saved under one plan, loaded under another mesh, plan or
device count, training goes on as if never stopped; exports are plain state dicts; saves are atomic;
damaged files, mismatched names and shapes, and values JSON cannot hold are clear errors."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shoal
from shoal import checkpoint
from shoal.checkpoint import writing
from shoal.checkpoint.reading import Source
from shoal.cli import main
from shoal.models import gpt
from shoal.testing import assert_same_value
from test_models import OPTIMIZERS, batches, fit, initial, mesh_for

B, S, P = shoal.B, shoal.S, shoal.P


def laid_out(kind: str, mesh: shoal.Mesh | None = None, model=None):
    mesh = mesh or mesh_for(kind)
    model = shoal.distribute_module(model or initial("gpt"), mesh, gpt.plans(mesh, kind))
    return model, OPTIMIZERS["adamw"](model.parameters())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """GPT trained 2 AdamW steps under dp,tp on 4 devices and saved; the losses of 4 steps without a stop."""
    path = tmp_path_factory.mktemp("ckpt") / "step-2"
    data = batches("gpt")
    model, opt = laid_out("dp,tp")
    losses = fit(model, opt, data[:2])
    checkpoint.save(path, {"model": model, "optim": opt, "step": 2, "data": {"pos": 7}})
    losses += fit(model, opt, data[2:4])
    return path, losses, {k: v.detach().full() for k, v in model.state_dict().items()}


def resume(path, kind: str, mesh: shoal.Mesh | None = None):
    model, opt = laid_out(kind, mesh)
    layouts = {k: v.sbp for k, v in model.state_dict().items()}
    result = checkpoint.load(path, {"model": model, "optim": opt})
    assert {k: v.sbp for k, v in model.state_dict().items()} == layouts  # loaded in place, in the new plan
    assert result.values == {"step": 2, "data": {"pos": 7}}
    assert result.missing_keys == result.unexpected_keys == []
    return model, opt, fit(model, opt, batches("gpt")[2:4])


def test_resumes_bit_exactly_in_the_same_plan(trained):
    path, losses, state = trained
    model, _, after = resume(path, "dp,tp")
    assert after == losses[2:]
    for k, v in model.state_dict().items():
        assert torch.equal(v.full(), state[k]), k


@pytest.mark.parametrize("kind, devices", [("tp", [0, 1, 2]), ("tp", [0, 1]), ("zero", [0, 1, 2, 3])])
def test_resumes_in_another_plan_and_device_count(trained, kind, devices):
    """dp,tp on 2x2 devices -> tp on 3 (uneven splits) or 2 devices, or ZeRO-1 on 4."""
    path, losses, state = trained
    axis = "tp" if kind == "tp" else "dp"
    model, opt, after = resume(path, kind, shoal.Mesh(devices, axes=(axis,)))
    torch.testing.assert_close(torch.tensor(after), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    for k, v in model.state_dict().items():
        assert_same_value(v.detach(), state[k], k, rtol=1e-5, atol=5e-6)
    assert all(isinstance(v, shoal.GlobalTensor) for st in opt.state.values() for k, v in st.items() if k != "step")


def test_each_shard_reads_only_its_slices(trained, monkeypatch):
    path, _, _ = trained
    mesh = shoal.Mesh([0, 1, 2], axes=("tp",))
    model, _ = laid_out("tp", mesh)
    counted = {}
    orig_read = Source.read

    def count(self, name, region, dtype):
        out = orig_read(self, name, region, dtype)
        counted[name] = counted.get(name, 0) + out.numel()
        return out

    monkeypatch.setattr(Source, "read", count)
    checkpoint.load(path, {"model": model})
    w = model.blocks[0].attn.q.weight  # S(0) over 3 devices: each reads its third
    assert w.sbp == (S(0),) and counted["model/blocks.0.attn.q.weight"] == w.numel()


def test_replicated_values_are_written_once_and_partial_ones_reduced(tmp_path):
    mesh = mesh_for("dp,tp")
    x = torch.arange(30.0).reshape(5, 6)
    rows = [x[:3], x[3:]]  # S(0) over dp; over tp two pieces that sum to the value
    part = shoal.from_local({0: rows[0] - 1, 1: torch.ones(3, 6), 2: rows[1] - 1, 3: torch.ones(2, 6)}, mesh, [S(0), P])
    state = {"rep": shoal.to_global(x, mesh, [B, B]), "split": shoal.to_global(x, mesh, [B, S(1)]),
             "part": part, "plain": x.clone()}
    checkpoint.save(tmp_path / "c", state)
    index = json.loads((tmp_path / "c" / "index.json").read_text())["tensors"]
    assert [len(index[k]["pieces"]) for k in state] == [1, 2, 2, 1]
    assert index["part"]["layout"] == "mesh 2x2 [S(0), P]"
    for k in state:
        target = shoal.to_global(torch.zeros(5, 6), mesh, [S(1), S(0)])
        checkpoint.load(tmp_path / "c", {k: target})
        assert torch.equal(target.full(), x), k


def test_tied_weights_are_stored_once(tmp_path):
    def tied():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
        m[1].weight = m[0].weight
        return m

    mesh = shoal.Mesh([0, 1, 2])
    m = shoal.distribute_module(tied(), mesh, {"*": S(0)})
    checkpoint.save(tmp_path / "c", {"model": m})
    assert json.loads((tmp_path / "c" / "index.json").read_text())["tensors"]["model/1.weight"] == {
        "same_as": "model/0.weight"}
    fresh = shoal.distribute_module(tied(), shoal.Mesh([0, 1]), {"*": S(1)})
    with torch.no_grad():
        fresh[0].weight.zero_()
    checkpoint.load(tmp_path / "c", {"model": fresh})
    assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight.full(), tied()[0].weight)
    checkpoint.export(tmp_path / "c", tmp_path / "m.safetensors")
    assert set(load_file(tmp_path / "m.safetensors")) == {"0.weight", "1.weight"}


def test_export_is_a_plain_state_dict(trained, tmp_path, capsys):
    path, _, _ = trained
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(path), str(out)]) == 0
    model, _ = laid_out("dp,tp")
    checkpoint.load(path, {"model": model})
    plain = initial("gpt")
    plain.load_state_dict(load_file(out))  # strict: the model's own names, nothing else
    for k, v in plain.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].full()), k
    assert main(["checkpoint", "info", str(path), "--verify"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"model/blocks.0.attn.q.weight +\[32, 32\] +float32 +mesh 2x2 \[B, S\(0\)\] +4.0 KiB", text)
    assert "optim/state/tok_emb.weight/exp_avg" in text and 'value data: {"pos": 7}' in text
    assert "optimizer optim: 1 parameter group(s) of 35 parameters; lr 0.001" in text
    assert main(["checkpoint", "info", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_plain_state_dict_loads_into_a_distributed_model(tmp_path):
    """A single-device model's state dict, saved by safetensors in float64, loads into a float32 model
    laid out by a plan (converted), directly or as the module of a mapping."""
    plain = initial("gpt")
    fit(plain, OPTIMIZERS["adamw"](plain.parameters()), batches("gpt")[:1])
    save_file({k: v.double() for k, v in plain.state_dict().items()}, tmp_path / "plain.safetensors")
    model, _ = laid_out("dp,tp")
    assert checkpoint.load(tmp_path / "plain.safetensors", model).missing_keys == []
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v.full(), plain.state_dict()[k]), k


def test_a_crash_before_publishing_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    model, opt = laid_out("dp")
    checkpoint.save(tmp_path / "step-1", {"model": model, "step": 1})
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1"

    def crash(*args):
        raise OSError("injected crash")

    with monkeypatch.context() as mp:
        mp.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="injected crash"):
            checkpoint.save(tmp_path / "step-2", {"model": model, "step": 2})
        with pytest.raises(OSError, match="injected crash"):  # replacing a checkpoint keeps it too
            checkpoint.save(tmp_path / "step-1", {"model": model, "step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    # a save killed before its rename leaves a .tmp- directory, complete or not: never the latest
    (tmp_path / "step-1").rename(tmp_path / "step-9.tmp-1234")
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / "step-9.tmp-1234").rename(tmp_path / "step-1")
    assert checkpoint.load(tmp_path / "step-1", {"model": model}).values == {"step": 1}
    assert checkpoint.latest(tmp_path / "missing") is None


KILLED_SAVE = """
import os, signal, sys
import torch
import shoal
from shoal import checkpoint
shoal.init(devices=2)
torch.manual_seed(0)
model = shoal.distribute_module(torch.nn.Linear(4, 3), shoal.Mesh([0, 1]), None)
checkpoint.save(sys.argv[1] + "/step-1", {"model": model, "step": 1})
with torch.no_grad():
    model.weight.add_(1.0)
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed once every shard is written
checkpoint.save(sys.argv[1] + "/step-2", {"model": model, "step": 2})
"""


def test_a_process_killed_before_publishing_leaves_the_last_checkpoint(tmp_path):
    """kill -9 between writing the shards and the rename that publishes them: the previous
    checkpoint is the latest and loads; the partial one is never picked."""
    p = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -9, p.stdout + p.stderr
    partial = [d for d in tmp_path.iterdir() if d.name != "step-1"]
    assert partial and all(any(f.suffix == ".safetensors" for f in d.rglob("*")) for d in partial), partial
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1"
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 3)
    model = shoal.distribute_module(torch.nn.Linear(4, 3), shoal.Mesh([0, 1]), None)
    assert checkpoint.load(tmp_path / "step-1", {"model": model}).values == {"step": 1}
    assert_same_value(model.weight.detach(), want.weight.detach(), rtol=0, atol=0)


def test_keep_and_overwrite(tmp_path):
    model, _ = laid_out("dp")
    for step in (1, 2, 3):
        checkpoint.save(tmp_path / f"step-{step}", {"model": model, "step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    checkpoint.save(tmp_path / "step-2", {"model": model, "step": 4})  # same path again: replaced, now newest
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"
    assert checkpoint.load(tmp_path / "step-2", {"model": model}).values == {"step": 4}
    with pytest.raises(ValueError, match="keep=0"):
        checkpoint.save(tmp_path / "x", {"model": model}, keep=0)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_named(trained, tmp_path, damage):
    path = tmp_path / "copy"
    shutil.copytree(trained[0], path)
    (shard,) = path.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    model, opt = laid_out("tp")
    before = model.state_dict()["tok_emb.weight"].full()
    with pytest.raises(ValueError, match=f"{shard}.*(sha256|truncated)"):
        checkpoint.load(path, {"model": model, "optim": opt})
    assert torch.equal(model.state_dict()["tok_emb.weight"].full(), before)
    if damage == "truncate":
        with pytest.raises(ValueError, match=f"{shard}.*truncated or corrupted"):  # unchecked: safetensors fails
            checkpoint.load(path, {"model": model}, verify=False)
        with pytest.raises(ValueError, match=f"{shard}.*truncated"):
            checkpoint.export(path, tmp_path / "m.safetensors")


def test_name_and_shape_mismatches_are_named(trained):
    path = trained[0]
    small = gpt.GPT(gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=4, n_embd=32))
    model, opt = laid_out("dp", model=small)
    before = {k: v.full() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"unexpected \['model/blocks.1.ln1.weight'.*pass strict=False"):
        checkpoint.load(path, {"model": model, "optim": opt})
    assert all(torch.equal(v.full(), before[k]) for k, v in model.state_dict().items())  # nothing loaded
    result = checkpoint.load(path, {"model": model}, strict=False)
    assert result.missing_keys == [] and "model/blocks.1.mlp.up.weight" in result.unexpected_keys
    assert "optim/state/blocks.1.ln1.weight/exp_avg" not in result.unexpected_keys  # only under the targets
    assert torch.equal(model.state_dict()["tok_emb.weight"].full(), trained_value(path, "tok_emb.weight"))
    result = checkpoint.load(path, {"model": model, "optim": opt}, strict=False)  # state follows the names
    assert {"optim/param_groups", "optim/state/blocks.1.ln1.weight"} <= set(result.unexpected_keys)
    assert len(opt.state) == 20 and all(st["step"] == 2 for st in opt.state.values())
    fit(model, opt, batches("gpt")[2:3])

    renamed = initial("gpt")
    renamed.head = renamed.lm_head
    del renamed.lm_head
    model, _ = laid_out("dp", model=renamed)
    result = checkpoint.load(path, {"model": model}, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["model/head.weight"], ["model/lm_head.weight"])

    wide = gpt.GPT(gpt.GPTConfig(vocab_size=15, block_size=8, n_layer=2, n_head=4, n_embd=32))
    model, _ = laid_out("dp", model=wide)
    with pytest.raises(ValueError, match=r"model/tok_emb.weight: saved shape \[13, 32\], target shape \[15, 32\]"):
        checkpoint.load(path, {"model": model}, strict=False)


def trained_value(path, name: str) -> torch.Tensor:
    plain = initial("gpt")
    checkpoint.load(path, plain)  # a bare module reads the checkpoint's one module, into plain torch too
    return plain.state_dict()[name]


def test_an_optimizer_needs_its_model_beside_it(trained, tmp_path):
    model, opt = laid_out("dp")
    with pytest.raises(ValueError, match="pass the model beside it"):
        checkpoint.save(tmp_path / "c", {"optim": opt})
    with pytest.raises(ValueError, match="pass the model beside it"):
        checkpoint.load(trained[0], {"optim": opt})


@pytest.mark.parametrize("value, message", [
    (object(), "'bad/0' is a object, which JSON cannot hold"),
    (float("nan"), "'bad/0' is nan"),
    ({1: 2}, "non-string key"),
    (torch.ones(2), "tensor inside a value"),
])
def test_values_json_cannot_hold_are_refused(tmp_path, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        checkpoint.save(tmp_path / "c", {"step": 1, "bad": [value]})
    assert not any(tmp_path.iterdir())


# -- background saves ------------------------------------------------------------------------------


def test_a_background_save_holds_the_values_as_of_the_save(trained, tmp_path, monkeypatch):
    """save(background=True) copies the shards before it returns: the AdamW steps that follow (while
    the writer is held back) change the parameters, not the checkpoint; a second save waits for it."""
    model, opt = laid_out("dp,tp")
    checkpoint.load(trained[0], {"model": model, "optim": opt})
    at_save = {k: v.detach().full() for k, v in model.state_dict().items()}
    release, write = threading.Event(), writing.write_safetensors

    def held(*args):
        assert release.wait(60)
        return write(*args)

    monkeypatch.setattr(writing, "write_safetensors", held)
    saving = checkpoint.save(tmp_path / "a", {"model": model, "optim": opt, "step": 2, "data": {"pos": 7}},
                             background=True)
    losses = fit(model, opt, batches("gpt")[2:4])
    assert losses == trained[1][2:]  # training is as without a save
    assert not saving.done() and not (tmp_path / "a").exists()
    threading.Timer(0.2, release.set).start()
    checkpoint.save(tmp_path / "b", {"model": model})  # waits for the save in flight
    assert saving.done() and saving.wait() == tmp_path / "a"
    assert any(not torch.equal(v.full(), at_save[k]) for k, v in model.state_dict().items())
    fresh, _ = laid_out("tp")
    checkpoint.load(tmp_path / "a", {"model": fresh})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full(), at_save[k]), k
    assert resume(tmp_path / "a", "dp,tp")[2] == losses
    state = opt.state[model.tok_emb.weight]["exp_avg"]
    checkpoint.load(tmp_path / "a", {"model": model, "optim": opt})  # into the state it has: read in place
    assert opt.state[model.tok_emb.weight]["exp_avg"] is state
    assert fit(model, opt, batches("gpt")[2:4]) == losses


def test_a_failed_background_save_raises_from_wait(tmp_path, monkeypatch):
    model, _ = laid_out("dp")

    def broken(*args):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(writing, "write_safetensors", broken)
    saving = checkpoint.save(tmp_path / "a", {"model": model}, background=True)
    with pytest.raises(OSError, match="disk full"):
        saving.wait()
    assert saving.done() and not any(tmp_path.iterdir())  # nothing published, the temporary directory gone
    checkpoint.save(tmp_path / "b", {"model": model}, background=True)  # fails; nobody waits for it
    with pytest.raises(RuntimeError, match=r"background save of .*b failed \(disk full"):
        checkpoint.save(tmp_path / "c", {"model": model})
    monkeypatch.undo()
    checkpoint.save(tmp_path / "c", {"model": model})
    assert checkpoint.latest(tmp_path) == tmp_path / "c"


# -- several processes -------------------------------------------------------------------------------

HEADER = """
import json, os, pathlib, sys, threading
sys.path.insert(0, {tests!r})
import torch, shoal
from shoal import checkpoint
shoal.init()
from test_checkpoint import laid_out
from test_models import batches, fit
data, path, rank = batches("gpt"), {path!r}, shoal.world().rank
"""


def launch(tmp_path: Path, body: str, processes: int, devices: int, path: Path) -> dict:
    """Run ``body`` after ``HEADER`` on ``processes`` x ``devices``; what rank 0 printed after RESULT."""
    script = tmp_path / f"worker-{processes}x{devices}.py"
    script.write_text(HEADER.format(tests=str(Path(__file__).parent), path=str(path)) + body)
    cmd = [sys.executable, "-m", "shoal.launch", "-n", str(processes), "--devices-per-process", str(devices),
           str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "SHOAL_TIMEOUT": "30"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(p.stdout.split("RESULT ", 1)[1].splitlines()[0])


RESHARD = """
model, opt = laid_out("dp,tp")  # devices 0, 1 (rank 0) hold every slice, 2 and 3 (rank 1) the same again
fit(model, opt, data[:2])
checkpoint.save(path + "/a", {"model": model, "optim": opt, "step": 2})
model, opt = laid_out("tp")  # each rank holds half of each split tensor
assert checkpoint.load(path + "/a", {"model": model, "optim": opt}).values == {"step": 2}
checkpoint.save(path + "/b", {"model": model, "optim": opt, "step": 2}, keep=1)
model, opt = laid_out("zero")
checkpoint.load(checkpoint.latest(path), {"model": model, "optim": opt})
losses = fit(model, opt, data[2:4])
if rank == 0:
    files = {c: sorted(os.listdir(os.path.join(path, c))) for c in os.listdir(path)}
    print("RESULT", json.dumps({"losses": losses, "files": files}))
"""


@pytest.mark.multiprocess
def test_two_processes_save_their_own_shards_and_load_another_plan(trained, tmp_path):
    """2 processes x 2 devices: each writes the slices it holds first (dp,tp: rank 1 holds replicas only);
    dp,tp -> tp -> ZeRO, training goes on as in one process."""
    result = launch(tmp_path, RESHARD, 2, 2, tmp_path / "ckpt")
    assert result["files"] == {"b": ["index.json", "shard-00000-of-00002.safetensors",
                                     "shard-00001-of-00002.safetensors"]}  # keep=1 removed a
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(trained[1][2:]), rtol=1e-5, atol=0)


BACKGROUND = """
from shoal.checkpoint import writing
trained, write = threading.Event(), writing.write_safetensors

def held(*args):  # rank 0 writes once its training steps are done; meanwhile rank 1's save waits for it
    assert trained.wait(60)
    return write(*args)

writing.write_safetensors = held
model, opt = laid_out("dp,tp")
fit(model, opt, data[:2])
saving = checkpoint.save(path, {"model": model, "optim": opt, "step": 2, "data": {"pos": 7}}, background=True)
losses = fit(model, opt, data[2:4])  # its collectives run while the save's barriers wait on their own group
assert not saving.done()
trained.set()
assert saving.wait() == pathlib.Path(path)
model, opt = laid_out("dp,tp")
checkpoint.load(path, {"model": model, "optim": opt})
resumed = fit(model, opt, data[2:4])
if rank == 0:
    print("RESULT", json.dumps({"losses": losses, "resumed": resumed}))
"""

ZERO1 = """
model, opt = laid_out("zero")  # dp over 4 processes x 1 device, AdamW's state split (ZeRO-1)
checkpoint.load(path, {"model": model, "optim": opt})
losses = fit(model, opt, data[2:4])
if rank == 0:
    print("RESULT", json.dumps({"losses": losses}))
"""


@pytest.fixture(scope="module")
def saved_on_two_processes(tmp_path_factory):
    """GPT trained 2 AdamW steps under dp,tp on 2 processes x 2 devices and saved in the background
    while 2 more steps ran; the losses of those 2 steps, and of 2 steps resumed from the checkpoint."""
    tmp = tmp_path_factory.mktemp("two")
    return tmp / "ckpt", launch(tmp, BACKGROUND, 2, 2, tmp / "ckpt")


def close(losses: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.mark.multiprocess
def test_a_background_save_on_two_processes_resumes_bit_exactly(saved_on_two_processes, trained):
    _, result = saved_on_two_processes
    assert result["resumed"] == result["losses"]  # the same plan on the same processes: bit-exact
    close(result["losses"], trained[1][2:])  # and the run is the one-process run's


@pytest.mark.multiprocess
def test_saved_on_two_processes_resumes_on_one_process_under_tp(saved_on_two_processes):
    """2 processes x 2 devices, dp,tp -> 1 process x 3 devices, tp (uneven splits)."""
    path, result = saved_on_two_processes
    close(resume(path, "tp", shoal.Mesh([0, 1, 2], axes=("tp",)))[2], result["losses"])


@pytest.mark.multiprocess
def test_saved_on_two_processes_resumes_on_four_under_zero1(saved_on_two_processes, tmp_path):
    """2 processes x 2 devices, dp,tp -> 4 processes x 1 device, dp with ZeRO-1."""
    path, result = saved_on_two_processes
    close(launch(tmp_path, ZERO1, 4, 1, path)["losses"], result["losses"])


@pytest.mark.multiprocess
def test_saved_on_two_processes_resumes_in_plain_torch(saved_on_two_processes):
    """2 processes x 2 devices, dp,tp -> a plain module and torch's AdamW on one device."""
    path, result = saved_on_two_processes
    model = initial("gpt")
    opt = OPTIMIZERS["adamw"](model.parameters())
    assert checkpoint.load(path, {"model": model, "optim": opt}).values == {"step": 2, "data": {"pos": 7}}
    assert all(type(v) is torch.Tensor for st in opt.state.values() for v in st.values())
    close(fit(model, opt, batches("gpt")[2:4]), result["losses"])


# -- training that resumes: shoal train --checkpoint-every N --checkpoint-dir D ----------------------

TINY = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set", "block_size=16"]
TRAIN = ["train", "gpt", "--devices", "2", "--plan", "dp", "--steps", "4", "--batch", "4", "--sample", "0",
         "--threads", "1", "--no-progress", "--checkpoint-every", "2", *TINY]


def final_state(directory: Path) -> dict:
    """The model's parameters in the last checkpoint of a run, as a plain state dict."""
    out = directory.parent / f"{directory.name}.safetensors"
    checkpoint.export(checkpoint.latest(directory), out)
    return load_file(out)


def test_a_stopped_run_resumes_where_it_stopped(tmp_path):
    """A run stopped after 2 of 4 steps and run again resumes from its checkpoint (model, optimizer, LR
    schedule, data order): losses and final parameters are those of the run never stopped."""
    from shoal.cli import _config, parser
    from shoal.train import train

    def run(name: str, stop_after=None):
        cfg = _config(parser().parse_args([*TRAIN, "--checkpoint-dir", str(tmp_path / name),
                                           "--out", str(tmp_path / f"{name}-run")]))
        cfg.stop_after, cfg.verbose = stop_after, False
        return train(cfg).losses

    whole = run("whole")
    assert len(run("stopped", stop_after=2)) == 2
    assert run("stopped") == whole
    want, got = final_state(tmp_path / "whole"), final_state(tmp_path / "stopped")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
