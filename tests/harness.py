"""Run a function on ``world_size`` gloo processes once, collect per-rank results, reap everything.

Starting ranks is the expensive part, so each world size is started once and runs many checks
inside (see tests/dist_checks.py). Ranks are forked by multiprocessing's fork server, which has
imported torch, the planner, the runtime and the Hugging Face models once for the whole session
(:data:`PRELOAD`): a freshly spawned rank spent ~2 s of CPU on imports, ~7 s with transformers'
model modules, and 4 or 8 of them share CI's 2 cores. A forked rank gets the launcher's
environment as it is at :func:`run_world` (the server's own is the one it started with). Every
rank is joined or killed before :func:`run_world` returns, whether the checks pass, fail, raise
or hang (the server reaps it); the server itself exits when the test process does (multiprocessing
closes its pipe).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# what every rank imports, once in the fork server (a module that is not installed is skipped)
PRELOAD = [
    "torch", "torch.distributed", "torch.export", "planner.search", "planner.runtime", "runtime.compile", "runtime.cdp",
    "tests.dist_checks", "tests.cdp_checks", "tests.hf_checks", "models.hf", "transformers",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "qwen2", "mistral", "bert", "vit", "bart", "mixtral", "t5")),
    "tests.world_traces",  # last: traces the Hugging Face worlds' models when their test runs (its docstring)
]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


WORKERS = min(2, os.cpu_count() or 1)  # processes that make a world's plans before it starts: CI has 2 cores


def map_in_workers(fn: Callable[..., Any], *iterables: Any, chunksize: int = 1) -> list[Any]:
    """``list(map(fn, *iterables))`` in :data:`WORKERS` processes of the fork server (``fn`` and
    its results picklable): planning a world's plans serially is much of its time."""
    with ProcessPoolExecutor(WORKERS, mp_context=_CONTEXT) as pool:
        return list(pool.map(fn, *iterables, chunksize=chunksize))


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any, pg_timeout: float, settle: bool,
           env: dict[str, str]) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # one compute thread a rank: more ranks than cores already, and torch's pool of one thread per
    # core in each of them made tiny ops spin (measured: 4 ranks on 2 cores, a 64 x 32 linear 24 ms)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        out.put((rank, "ok", result))
        if settle:  # (a test that breaks the world on purpose does not settle it)
            dist.barrier()  # before destroy: avoids a rare abort at exit after collectives in backward
            dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0,
              settle: bool = True) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns the ranks' results (rank order).
    ``pg_timeout``: the process group's timeout (s); ``settle=False``: no closing barrier (the
    function broke the world on purpose)."""
    out = _CONTEXT.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [_CONTEXT.Process(target=_entry, args=(r, world, port, fn, args, out, pg_timeout, settle, env), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) + len(errors) < world:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                errors.append(f"timed out after {timeout:.0f} s waiting for {world - len(results) - len(errors)} rank(s)")
                break
            try:
                rank, status, payload = out.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and out.empty():
                    codes = [p.exitcode for p in procs]
                    errors.append(f"a rank died without reporting (exit codes {codes})")
                    break
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
