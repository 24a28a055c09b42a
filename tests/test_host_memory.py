"""runtime.host_memory: a CPU training process keeps its freed tensors' pages instead of faulting them in every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# a step's worth of large temporaries, allocated, written and freed six times; the page faults of
# the last four (the first two fault in what the heap grows to, as any caching allocator's warm-up)
PROBE = """
import json, resource, sys
import torch
if sys.argv[1] == "keep":
    from planner.runtime.host_memory import keep_freed_memory
    assert keep_freed_memory()
def step():
    ts = [torch.empty(2**23).fill_(1.0) for _ in range(4)]  # 4 x 32 MiB
    del ts
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def _faults(mode: str) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    env.pop("PLANNER_HOST_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_tensors_pages_are_reused_not_faulted_in_again() -> None:
    system, kept = _faults("system"), _faults("keep")
    pages = 4 * 4 * 2**25 // 4096  # four steps of 128 MiB
    assert system > pages // 2, f"glibc's default malloc faulted only {system} pages in for {pages} pages of fresh tensors"
    # one tensor's pages (8,192) are sometimes faulted in once more in the third or fourth step
    assert kept <= pages // 8, f"{kept} page faults over {pages} pages of reused tensors"
