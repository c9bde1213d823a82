"""The command line as a new user meets it: ``shoal`` (``python -m shoal``), ``shoal run``, the rule
validator's ``python -m shoal.ops.validate``. Mistakes are one clear line and a non-zero exit status."""

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from shoal import cli
from shoal.train import TrainConfig, train

TIMEOUT = 120  # a check that is missing may start processes; never hang the suite on it


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=None if env is None else {**os.environ, **env})


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_validate_unknown_op_is_an_error_naming_it():
    p = run("-m", "shoal.ops.validate", "nosuchop")
    assert p.returncode != 0
    assert "nosuchop" in p.stderr and "--list" in p.stderr
    assert "Traceback" not in p.stderr and "0 ops" not in p.stdout


def test_validate_help_prints_usage_and_runs_nothing():
    p = run("-m", "shoal.ops.validate", "--help")
    assert p.returncode == 0
    assert p.stdout.startswith("usage: python -m shoal.ops.validate")
    assert "failure(s)" not in p.stdout


def test_version():
    p = run("-m", "shoal", "--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"shoal {version('shoal')}"


@pytest.mark.parametrize("command", [("shoal", "run", "--help"), ("shoal", "train", "--help"),
                                     ("shoal.demo", "--help")], ids=" ".join)
def test_help_is_plain_text(command):
    p = run("-m", *command)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: ")
    assert "``" not in p.stdout and ":func:" not in p.stdout and ":class:" not in p.stdout


def one_clear_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode != 0
    assert "Traceback" not in p.stdout + p.stderr
    assert lines(p.stderr) and len(lines(p.stderr)) == 1, p.stderr
    return p.stderr


def test_run_checks_train_devices_before_launching():
    # 2 processes x 1 device, but shoal train's default is 4 devices
    err = one_clear_line(run("-m", "shoal", "run", "-n", "2", "-m", "shoal", "train", "gpt", "--steps", "10"))
    assert err.startswith("shoal run: error:") and "--devices 2" in err
    assert run("-m", "shoal", "run", "-n", "2", "-m", "shoal", "train", "gpt", "--mesh", "2x2",
               "--devices", "2").stderr.count("mesh 2x2 has 4 devices") == 1


def test_train_under_torchrun_with_devices_not_fitting_is_one_line():
    # as torchrun starts each rank: the check runs before torch.distributed is set up
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "SHOAL_DEVICES_PER_PROCESS": "1"}
    err = one_clear_line(run("-m", "shoal", "train", "gpt", "--steps", "1", env=env))
    assert err.startswith("shoal train: error:") and "2 processes x 1 device(s)" in err


def test_world_error():
    assert cli.world_error(TrainConfig(devices=4), 2, 1) is not None
    assert "--devices-per-process 2" in cli.world_error(TrainConfig(devices=4), 2, 1)
    assert cli.world_error(TrainConfig(devices=2), 2, 1) is None
    assert cli.world_error(TrainConfig(devices=4), 2, 2) is None
    assert cli.world_error(TrainConfig(devices=3), 2, None) is not None  # plain torchrun: must divide
    assert cli.world_error(TrainConfig(devices=4), 2, None) is None
    assert cli.world_error(TrainConfig(devices=4, plan="none"), 2, 1) is None  # each rank trains alone
    assert cli.world_error(TrainConfig(devices=4), 1, 1) is None


def test_devices_auto_needs_processes_to_count(capsys):
    assert cli.main(["train", "gpt", "--devices", "auto", "--steps", "1"]) == 2
    assert "--devices auto counts the devices of the processes shoal run starts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["train", "gpt", "--devices", "0"])
    assert "expected a positive number or 'auto'" in capsys.readouterr().err


def test_check_launch_only_looks_at_shoal_train():
    assert cli.check_launch("script.py", False, ["train", "gpt"], 2, 1) is None
    # processes known only when they start (--nnodes 1:2): the device count must follow them
    assert "--devices auto" in cli.check_launch("shoal", True, ["train", "gpt"], None, 1)
    assert cli.check_launch("shoal", True, ["train", "gpt", "--devices", "auto"], None, 1) is None
    assert cli.check_launch("shoal", True, ["train", "gpt", "--devices", "auto"], 2, 2) is None
    assert "mesh 2x2 has 4 devices" in cli.check_launch("shoal", True, ["train", "gpt", "--devices", "auto",
                                                                         "--mesh", "2x2"], 3, 1)
    assert cli.check_launch("shoal", True, ["train", "gpt"], 2, 1) is not None
    assert cli.check_launch("shoal", True, ["train", "gpt", "--devices", "2"], 2, 1) is None


def test_memory_per_device_counts_gradients():
    # data parallel AdamW: every device holds the parameters, their gradients and two moments
    cfg = TrainConfig(model="gpt", plan="dp", devices=4, steps=1, batch=4, save=False, verbose=False,
                      progress=False, sample=0, model_args={"n_layer": 1, "n_embd": 32, "block_size": 16})
    r = train(cfg)
    assert r.memory == {d: 4 * r.params * 4 for d in range(4)}


@pytest.mark.parametrize("plan,mesh,schedule", [("pp,dp", (2, 2), "1f1b"), ("pp,dp", (2, 2), "zb")])
def test_pipelined_training_equals_data_parallel(plan, mesh, schedule):
    """``shoal train gpt --plan pp,dp --mesh 2x2 --micro-batches 4``: the same losses as ``--plan dp``
    (micro-batches of equal size: the mean of their mean losses is the batch's)."""
    small = {"n_layer": 2, "n_embd": 32, "block_size": 16}
    common = dict(model="gpt", devices=4, steps=3, batch=8, save=False, verbose=False, progress=False, sample=0,
                  model_args=small)
    want = train(TrainConfig(plan="dp", **common)).losses
    got = train(TrainConfig(plan=plan, mesh=mesh, micro_batches=4, schedule=schedule, **common)).losses
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("plan", ["tp=2,dp=2,sp=true", "pp=2,tp=2,sp=true,schedule=interleaved,v=2,recompute=full",
                                  "pp=2,dp=2,mb=2,zero=1"])
def test_train_takes_the_keys_of_shoal_plan(plan):
    """``shoal train gpt --plan tp=2,dp=2,sp=true`` (``auto.Parallel``'s keys, as ``shoal plan`` takes
    them): the mesh, micro-batches and schedule follow from the plan, and the losses are those of plain
    torch on one device."""
    common = dict(model="gpt", devices=4, steps=3, batch=8, save=False, verbose=False, progress=False, sample=0,
                  model_args={"n_layer": 4, "n_embd": 32, "block_size": 16})
    want = train(TrainConfig(plan="none", **common)).losses
    got = train(TrainConfig(plan=plan, **common)).losses
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("config, message", [
    (dict(plan="tp=2,dp=2", model="bert"), "lay out a GPT"),
    (dict(plan="tp=2,dp=2", mesh=(4,)), "--mesh 4 disagrees"),
    (dict(plan="tp=3"), "make the product 4"),
    (dict(plan="dp=4,sp=true"), "needs tp > 1"),
    (dict(plan="pp=2,dp=2", batch=6), "does not split into 2 data-parallel ranks x 4 micro-batches"),
    (dict(plan="tp=2,dp=2,mb=3"), "not a multiple of dp x micro_batch"),
    (dict(plan="pp=2,dp=2,schedule=gpipe", schedule="zb"), "--schedule zb disagrees with --plan"),
    (dict(plan="tp=2,dp=2,precision=fp32", precision="bf16"), "--precision bf16 disagrees"),
    (dict(plan="pp=2,dp=2,mb=2", batch=16, micro_batches=2), "--micro-batches 2 disagrees .* \\(4\\)"),
])
def test_plans_by_their_keys_say_what_is_wrong(config, message):
    cfg = TrainConfig(**{**dict(devices=4, steps=1, save=False, verbose=False, progress=False), **config})
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_pipelined_plans_say_what_they_need():
    with pytest.raises(ValueError, match="--mesh"):
        train(TrainConfig(plan="pp,dp", micro_batches=4, verbose=False, save=False))
    with pytest.raises(ValueError, match="--micro-batches"):
        train(TrainConfig(plan="pp,dp", mesh=(2, 2), verbose=False, save=False))


@pytest.mark.parametrize("compile", [False, True])
def test_zero3_with_checkpointing_equals_data_parallel(compile):
    """``shoal train gpt --plan zero3 --checkpoint 'blocks.*'``: the losses of ``--plan dp``."""
    common = dict(model="gpt", devices=4, steps=3, batch=8, save=False, verbose=False, progress=False, sample=0,
                  model_args={"n_layer": 2, "n_embd": 32, "block_size": 16}, compile=compile)
    want = train(TrainConfig(plan="dp", **common)).losses
    got = train(TrainConfig(plan="zero3", checkpoint=("blocks.*",), **common))
    assert got.losses == pytest.approx(want, rel=1e-5)
    assert max(got.memory.values()) * 4 == pytest.approx(4 * got.params * 4, rel=0.02)  # 16 bytes / 4 devices


def test_the_cli_reads_checkpoint_and_precision():
    from shoal.cli import _config, parser

    args = parser().parse_args(["train", "gpt", "--plan", "zero3", "--checkpoint", "blocks.*", "--checkpoint", "ln_f",
                                      "--precision", "bf16"])
    cfg = _config(args)
    assert (cfg.plan, tuple(cfg.checkpoint), cfg.precision) == ("zero3", ("blocks.*", "ln_f"), "bf16")


def test_checkpoint_patterns_reach_the_plan():
    """``--checkpoint`` is passed on to the plan, not dropped: a pattern naming no module is its error."""
    cfg = TrainConfig(model="gpt", devices=4, plan="dp", steps=1, batch=4, save=False, verbose=False, progress=False,
                      sample=0, model_args={"n_layer": 1, "n_embd": 16, "block_size": 8}, checkpoint=("block.*",))
    with pytest.raises(ValueError, match=r"checkpoint.*'block\.\*'.*names look like"):
        train(cfg)


def test_a_script_runs_itself_on_processes(monkeypatch):
    """``shoal.launch.on_processes(n)``: outside torchrun it runs the script again under ``shoal run -n
    n`` with its arguments and exits with that status; under torchrun (RANK set) it returns."""
    import shoal.launch as launch

    calls = []
    monkeypatch.setattr(launch, "main", lambda argv: calls.append(argv) or 3)
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--reps", "5"])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        launch.on_processes(2)
    assert stop.value.code == 3 and calls == [["-n", "2", "bench/x.py", "--reps", "5"]]
    monkeypatch.setenv("RANK", "0")
    assert launch.on_processes(2) is None and len(calls) == 1
