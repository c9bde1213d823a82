"""``shoal run``: launch a script on P processes (torchrun underneath), K devices each.

``shoal run -n 2 --devices-per-process 2 script.py args...`` runs torch.distributed.run with
``--nproc-per-node 2`` and ``SHOAL_DEVICES_PER_PROCESS=2``; torchrun's multi-node options pass
through (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-conf``, ``--max-restarts``,
``--master-port``; under ``--nnodes min:max`` give ``shoal train --devices auto``).
When a process fails, torchrun stops the others and names the failed rank ("Root Cause"). A
``check`` given to ``main`` (the ``shoal`` command's, for ``-m shoal train``) runs first: a mistake
in the arguments is one line and exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

__all__ = ["main", "build_command", "on_processes"]

_PASS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--rdzv-conf", "--max-restarts",
         "--master-addr", "--master-port", "--monitor-interval")


# (script, run as a module, its arguments, processes in all or None if not known, devices per process)
# -> what is wrong, or None
Check = Callable[[str, bool, list, int | None, int], str | None]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Launch a script on P processes (torchrun underneath), K devices each.\n"
        "Every process runs the whole script; shoal.init() there sees the world of P x K devices.",
        epilog="examples:\n"
        "  shoal run -n 2 --devices-per-process 2 script.py args...\n"
        "  shoal run -n 2 -m shoal train gpt --devices 2 --plan dp --steps 100",
    )
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, help="processes on this node")
    p.add_argument("--devices-per-process", type=int, default=1, help="devices each process owns (default 1)")
    for opt in _PASS:
        p.add_argument(opt, type=str, default=None, help="passed to torchrun")
    p.add_argument("-m", "--module", action="store_true", help="run script as a module (python -m script)")
    p.add_argument("script", help="the Python script (or, with -m, module) to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def build_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    a = _arguments(argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.nproc_per_node}"]
    for opt in _PASS:
        v = getattr(a, opt.lstrip("-").replace("-", "_"))
        if v is not None:
            cmd.append(f"{opt}={v}")
    if a.nnodes is None and a.rdzv_endpoint is None and a.master_port is None:
        cmd.append("--standalone")
    if a.module:
        cmd.append("--module")
    cmd += [a.script, *a.args]
    env = dict(os.environ, SHOAL_DEVICES_PER_PROCESS=str(a.devices_per_process))
    env.setdefault("OMP_NUM_THREADS", "1")
    if _processes(a) is None:
        # A node joining a running elastic world re-forms it in a new rendezvous round, whose
        # store keys the agent that stays rank 0 never writes when it shares its TCPStore with the
        # workers (torch reuses the first round's bootstrap info): the joiner would wait forever.
        # Unshared, every round's rank-0 worker hosts a fresh store.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return cmd, env


def _arguments(argv: list[str]) -> argparse.Namespace:
    a = parser().parse_args(argv)
    if a.nproc_per_node < 1 or a.devices_per_process < 1:
        raise SystemExit("shoal run: error: -n and --devices-per-process must be positive")
    return a


def _processes(a: argparse.Namespace) -> int | None:
    """Processes in all: -n times --nnodes (None where --nnodes is a range, e.g. 1:4)."""
    try:
        return a.nproc_per_node * int(a.nnodes or 1)
    except ValueError:
        return None


def main(argv: list[str] | None = None, check: Check | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if check is not None:
        a = _arguments(argv)
        problem = check(a.script, a.module, a.args, _processes(a), a.devices_per_process)
        if problem:
            print(f"shoal run: error: {problem}", file=sys.stderr)
            return 2
    cmd, env = build_command(argv)
    return subprocess.call(cmd, env=env)


def on_processes(n: int) -> None:
    """A script that runs itself on ``n`` processes: outside torchrun, run this script again under
    ``shoal run -n n`` with the same arguments and exit with its status; under it, return."""
    if "RANK" not in os.environ:
        sys.exit(main(["-n", str(n), *sys.argv]))


if __name__ == "__main__":
    sys.exit(main())
