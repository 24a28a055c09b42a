"""A stalled or dead rank named: a collective that fails says which collective, and which rank.

gloo reports a peer that stopped answering as ``Timed out waiting 30000ms for recv operation to
complete`` (after the process group's timeout), and a dead one as ``Connection closed by peer``:
neither names the collective nor the rank to look at. Every collective the runtime issues is
wrapped so that, when it raises, :func:`failed` turns the error into a :class:`CollectiveError`:

1. this rank posts what failed under ``planner/fault/<rank>`` in the process group's store;
2. it waits up to ``grace_s()`` seconds (``PLANNER_FAULT_GRACE_S``, default 3) for the other
   ranks of the collective's group to post theirs: healthy ones fail the same collective within a
   moment (their own timeout, or a closed connection once a peer is gone);
3. the ranks that never posted are the ones to look at: stalled (hung, or far behind) or dead;
4. it posts that it has read the others' reports; the rank that hosts the store (rank 0 when
   launched by hand) waits, up to another ``grace_s()``, until every rank that reported has posted
   so, since its exit takes the store with it (a survivor still comparing would find it gone).

So a stalled rank fails the others after the process group's timeout (``init_process_group(timeout=)``,
torch's default 30 min; set it to a few times your slowest step) plus ``grace_s()``; a dead rank's
peers fail at once plus ``grace_s()`` (the store's host: up to two). The message names the
collective (kind, mesh axes, phase), its group's ranks, the ranks that did not report, and gloo's
own words. The store lives with torchrun's agent (or on rank 0 when launched by hand: if rank 0
is the dead one, the message says the store did not answer). Under NCCL, torch's own watchdog may
abort the process first (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); its log names the collective by
sequence number.

A failure leaves the process group unusable: the training script should exit (non-zero), and
``torchrun --max-restarts N`` restarts every rank, which resume from the newest complete checkpoint
(``examples/train_large.py`` does; README, "Faults and restarts").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def grace_s() -> float:
    """Seconds a failing rank waits for the others' reports: ``PLANNER_FAULT_GRACE_S`` (default
    3), read when a collective fails (a process forked after this module was imported still
    sees the value its launcher set)."""
    return float(os.environ.get("PLANNER_FAULT_GRACE_S", "3"))

_KEY = "planner/fault/{}"
_READ = "planner/fault/{}/read"
_SOURCE = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")  # gloo's "[/path/to/pair.cc:553] " prefix


class CollectiveError(RuntimeError):
    """A collective failed because a rank of its group stalled or died; the message names both."""


def failed(what: str, ranks: Sequence[int], exc: BaseException) -> CollectiveError:
    """The error to raise (``from exc``) when the collective ``what`` over ``ranks`` raised ``exc``."""
    if isinstance(exc, CollectiveError):
        return exc
    me = dist.get_rank() if dist.is_initialized() else 0
    lines = str(exc).strip().splitlines()
    cause = _SOURCE.sub("", lines[0]).split(". ")[0].rstrip(".") if lines else type(exc).__name__  # gloo's first sentence
    head = f"rank {me}: {what} over ranks {_ranks(ranks)} failed: {cause}."
    try:
        reported = _compare(me, what, [r for r in ranks if r != me])
    except Exception as store_exc:  # the store itself is gone (it lived on a dead rank 0)
        return CollectiveError(f"{head} The store did not answer to compare ranks ({type(store_exc).__name__}): rank 0 is likely dead; "
                               "read its log.")
    silent = [r for r in ranks if r != me and r not in reported]
    if silent:
        others = f" {_plural('Rank', reported)} {_ranks(sorted(reported))} failed too." if reported else ""
        return CollectiveError(f"{head} {_plural('Rank', silent)} {_ranks(silent)} did not report within {grace_s():g} s: "
                               f"stalled or dead, read {'their' if len(silent) > 1 else 'its'} log.{others} (A stall shows after the "
                               "process group's timeout, init_process_group(timeout=...).)")
    elsewhere = {r: w for r, w in reported.items() if w != what}
    tail = "".join(f" Rank {r} failed in {w}." for r, w in sorted(elsewhere.items()))
    return CollectiveError(f"{head} Every other rank of the group reported a failure too: the cause is further along.{tail}")


def _compare(me: int, what: str, others: list[int]) -> dict[int, str]:
    """Post this rank's failure; the failures the ``others`` post within :func:`grace_s`. The
    store's host then stays until the ranks that reported have read theirs (step 4 above)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_KEY.format(me), json.dumps({"what": what}))
    reported: dict[int, str] = {}
    deadline = time.monotonic() + grace_s()
    while True:
        for r in others:
            if r not in reported and store.check([_KEY.format(r)]):
                reported[r] = json.loads(store.get(_KEY.format(r)))["what"]
        if len(reported) == len(others) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    store.set(_READ.format(me), "1")
    if _hosts_store(me) and reported:
        # each rank that reported did so by our deadline, so it stops comparing at most one grace after it
        deadline = time.monotonic() + grace_s()
        while not store.check([_READ.format(r) for r in reported]) and time.monotonic() < deadline:
            time.sleep(0.05)
    return reported


def _hosts_store(me: int) -> bool:
    """Whether this process hosts the default store: rank 0, unless torchrun's agent hosts it."""
    return me == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _plural(word: str, items: Sequence[int] | dict[int, str]) -> str:
    return word + ("s" if len(items) > 1 else "")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (the world where None)."""
    return list(range(dist.get_world_size())) if group is None else list(dist.get_process_group_ranks(group))


class NamedWork:
    """An asynchronous operation's work whose ``wait()`` raises :func:`failed`'s error."""

    __slots__ = ("ranks", "what", "work")

    def __init__(self, work: Any, what: str, ranks: Sequence[int]) -> None:
        self.work, self.what, self.ranks = work, what, ranks

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise failed(self.what, self.ranks, exc) from exc

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())


def recv(t: torch.Tensor, src: int, tag: int, what: str) -> None:
    """``dist.recv`` from global rank ``src``; a failure names ``what`` and whether ``src`` stalled."""
    try:
        dist.recv(t, src, tag=tag)
    except RuntimeError as exc:
        raise failed(f"{what} (receive from rank {src})", [dist.get_rank(), src], exc) from exc


def isend(t: torch.Tensor, dst: int, tag: int, what: str) -> NamedWork:
    """``dist.isend`` to global rank ``dst``, its wait naming ``what`` when it fails."""
    try:
        work = dist.isend(t, dst, tag=tag)
    except RuntimeError as exc:
        raise failed(f"{what} (send to rank {dst})", [dist.get_rank(), dst], exc) from exc
    return NamedWork(work, f"{what} (send to rank {dst})", [dist.get_rank(), dst])


def irecv(t: torch.Tensor, src: int, tag: int, what: str) -> NamedWork:
    """``dist.irecv`` from global rank ``src``, its wait naming ``what`` when it fails."""
    return NamedWork(dist.irecv(t, src, tag=tag), f"{what} (receive from rank {src})", [dist.get_rank(), src])
