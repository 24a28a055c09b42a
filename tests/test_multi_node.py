"""Several hosts: two torchrun launches on this host, each a "node" of 2 processes meeting at one
rendezvous endpoint (``--nnodes 2 --node-rank K --rdzv-backend c10d``), train examples/train_large.py
(a meta-built model, ZeRO-3 over all 4 ranks: the mesh spans both nodes) with the losses of one
launch of 4 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["examples/train_large.py", "--steps", "3", "--batch", "8", "--dtype", "float64", "--tp", "none", "--dp", "4", "--zero", "3"]


def _launch(args: list[str], tmp: Path, name: str) -> subprocess.Popen[bytes]:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(tmp / f"{name}.log", "wb") as log:  # the launch writes through its own copy of the handle
        return subprocess.Popen([str(torchrun), *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen[bytes]], tmp: Path, timeout: float = 400) -> None:
    """Every launch ends (or is killed), whatever happens; a failure shows its log."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [p for p in procs if p.returncode != 0]
    if failed:
        logs = "\n".join((tmp / f).read_text(errors="replace")[-3000:] for f in os.listdir(tmp) if f.endswith(".log"))
        pytest.fail(f"a launch failed (exit codes {[p.returncode for p in procs]}):\n{logs}")


def test_two_nodes_of_two_train_as_one_launch_of_four(tmp_path: Path) -> None:
    one = tmp_path / "one"
    _wait([_launch(["--nproc-per-node", "4", "--master-port", str(free_port()), *TRAIN, "--out", str(one), "--losses", str(tmp_path / "one.json")],
                   tmp_path, "one")], tmp_path)
    port = free_port()
    nodes = [
        _launch(["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", "two-nodes", *TRAIN, "--out", str(tmp_path / "two"), "--losses", str(tmp_path / "two.json")], tmp_path, f"node{k}")
        for k in range(2)
    ]
    _wait(nodes, tmp_path)
    want = json.loads((tmp_path / "one.json").read_text())
    got = json.loads((tmp_path / "two.json").read_text())
    assert len(want) == 3 and got.keys() == want.keys()
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-12 * abs(loss), (step, got[step], loss)
