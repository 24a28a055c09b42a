"""Meta in, shards out: each rank materialises only its own shards of a model built on the meta device.

A model built under ``torch.device("meta")`` has shapes and no values. To give each rank the
values the same model would hold had it been built on one CPU under the same seed, the
initialisation is **recorded** on the meta device (an op tape: cheap, nothing allocated) and
**replayed** on real tensors, in the same order, under the process's current random state, so
every random draw is the one the CPU build makes. What the replay keeps of a parameter is only
this rank's shard (``keep``); the full tensor lives from the first op of its last write to the
last op that touches it, one parameter at a time for initialisations that go module by module
(all of torch's layers and the presets here): a rank's peak while materialising is its shards plus
the largest parameter (tests/test_materialize.py measures it).

**What is replayed** (:func:`default_init`): what building the model on a CPU runs, in order:

1. every torch layer's own ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``,
   ``nn.LayerNorm``, ``nn.Conv*``, ...), in ``model.modules()`` order: each layer's constructor
   calls it, and modules register in the order they are built;
2. the model's own initialiser, if its root defines one: ``reset_parameters()``, or
   ``init_weights()`` (torchtitan's convention).

Seed and build as you would on a CPU (``torch.manual_seed(s)``, then the constructor under
``torch.device("meta")``), then compile: the replay draws from the global generator where the CPU
build would have. A model initialised some other way passes its own ``init(model)`` (any code of
in-place torch ops on the parameters; it runs on the meta model under the recorder). Every random
value is drawn on every rank (a CPU generator cannot skip ahead), so materialising costs each rank
the time, not the memory, of initialising the whole model.

A parameter no recorded op writes (a value made in the constructor from data, ``torch.randn`` in
``__init__``) cannot be reproduced: :class:`MaterializeError` names it; load weights instead
(:mod:`runtime.weights`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# in-place ops that write every element of their first argument without reading it
_OVERWRITE = frozenset({
    "aten.normal_.default", "aten.uniform_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default",
    "aten.copy_.default", "aten.exponential_.default", "aten.random_.default", "aten.random_.from", "aten.random_.to",
    "aten.bernoulli_.float", "aten.cauchy_.default", "aten.log_normal_.default", "aten.geometric_.default",
})


class MaterializeError(ValueError):
    """A meta model that cannot be materialised as asked (the message names what and the remedy)."""


def is_meta_module(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def default_init(model: torch.nn.Module) -> None:
    """What building ``model`` on a CPU runs (see the module docstring): each torch layer's
    ``reset_parameters()`` in module order, then the root's ``reset_parameters()`` or
    ``init_weights()``."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if type(module).__module__.startswith("torch.nn.") and callable(reset):
            reset()
    if type(model).__module__.startswith("torch.nn."):
        return
    for name in ("reset_parameters", "init_weights"):
        method = getattr(model, name, None)
        if callable(method):
            method()
            return


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    reads: set[int] = field(default_factory=set)  # storages it reads or writes in part
    overwrites: int | None = None  # the storage it writes whole without reading


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.tape: list[_Op] = []
        self.keep_alive: list[torch.Tensor] = []  # recorded meta tensors: their ids stay unique

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        op = _Op(func, args, kwargs, outs, {_storage(t) for t in tensors})
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if str(func) in _OVERWRITE and target is not None and _covers_storage(target):
            others = {_storage(t) for t in tensors[1:]}
            if _storage(target) not in others:
                op.overwrites = _storage(target)
                op.reads.discard(op.overwrites)
        self.tape.append(op)
        self.keep_alive.extend(tensors + outs)
        return out


def _covers_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def record(model: torch.nn.Module, init: Callable[[torch.nn.Module], None] | None = None) -> list[_Op]:
    """The aten ops ``init(model)`` (default :func:`default_init`) runs on the meta model."""
    recorder = _Recorder()
    rng = torch.get_rng_state()  # a CPU draw the init makes (a constant it computes) is made again in the replay, in its place
    try:
        with torch.no_grad(), recorder:
            (init or default_init)(model)
    except Exception as exc:  # e.g. .item() on a meta tensor: the init reads values
        raise MaterializeError(
            f"initialising the meta model failed ({type(exc).__name__}: {exc}); an initialisation that reads tensor values cannot "
            "run on the meta device: pass init= with one that only writes them, or load weights (runtime.weights)"
        ) from exc
    finally:
        torch.set_rng_state(rng)
    return recorder.tape


def materialize(model: torch.nn.Module, keep: Callable[[str, torch.Tensor], None], *,
                init: Callable[[torch.nn.Module], None] | None = None, names: Collection[str] | None = None, prune: bool = False) -> None:
    """Replay ``model``'s initialisation on real CPU tensors and hand each parameter and buffer to
    ``keep(name, full_value)`` once, when its value is final (the tensor is freed after ``keep``
    returns: keep a slice's clone, not a view), under its first name (tied weights are one tensor).
    ``names``: only the tensors of these names (default: every meta parameter and buffer). ``prune``:
    skip the ops nothing of ``names`` depends on (the rest of the model comes from a file; a random
    draw skipped moves the later ones, so the values are then reproducible but not the CPU
    build's). See the module docstring."""
    tape = record(model, init)
    owners: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)):
        if t.is_meta and (names is None or name in names):
            owners.setdefault(_storage(t), (name, t))
    missing = [name for st, (name, _) in owners.items() if not any(op.overwrites == st for op in tape)]
    if missing:
        raise MaterializeError(
            f"no initialisation writes {', '.join(sorted(missing)[:5])}{' ...' if len(missing) > 5 else ''} (built on meta; its value came "
            "from the constructor, which cannot be replayed): give the model a reset_parameters() that sets it, pass init=, or load weights"
        )
    if prune:
        tape = _needed(tape, set(owners))
    _Replay(tape, owners, keep).run()


def _needed(tape: list[_Op], storages: set[int]) -> list[_Op]:
    """The ops of ``tape`` that the final values of ``storages`` depend on (conservatively: every
    op touching a storage an op kept touches)."""
    needed, kept = set(storages), []
    for op in reversed(tape):
        touched = _touches(op)
        if touched & needed:
            needed |= touched
            kept.append(op)
    return kept[::-1]


def _touches(op: _Op) -> set[int]:
    return op.reads | ({op.overwrites} if op.overwrites is not None else set()) | {_storage(t) for t in op.outputs}


class _Replay:
    """The tape on real tensors: each meta storage maps to a real tensor on one storage of the same
    layout; a meta tensor maps to the view of it at the same size, stride and offset."""

    def __init__(self, tape: list[_Op], owners: dict[int, tuple[str, torch.Tensor]], keep: Callable[[str, torch.Tensor], None]) -> None:
        self.tape, self.owners, self.keep = tape, owners, keep
        self.real: dict[int, torch.Tensor] = {}  # meta storage -> a real tensor spanning its real storage
        touched: dict[int, list[int]] = defaultdict(list)  # storage -> the ops touching it, in order
        for i, op in enumerate(tape):
            for st in _touches(op):
                touched[st].append(i)
        # a storage's values are dead after op i when the next op touching it overwrites it (or none
        # does): free it there, and hand an owner's last value to keep()
        self.free_after: dict[int, list[int]] = defaultdict(list)
        for st, ops in touched.items():
            for k, i in enumerate(ops):
                if k + 1 == len(ops) or tape[ops[k + 1]].overwrites == st:
                    self.free_after[i].append(st)
        self.last = {st: ops[-1] for st, ops in touched.items()}

    def _real(self, t: torch.Tensor, writes_whole: bool) -> torch.Tensor:
        st = _storage(t)
        if st not in self.real and not t.is_meta:  # a CPU tensor from before the init: a constant
            return t
        if st not in self.real:  # a parameter or buffer first touched here: a fresh buffer of its storage
            name = self.owners[st][0] if st in self.owners else f"a meta tensor of shape {tuple(t.shape)}"
            if not writes_whole:
                raise MaterializeError(f"the initialisation reads {name} before writing it (its value came from the constructor, "
                                       "which cannot be replayed): pass init= that writes it first, or load weights")
            self.real[st] = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
        base = self.real[st]
        if base.dtype != t.dtype:
            raise MaterializeError(f"the initialisation views a {base.dtype} tensor as {t.dtype}; it cannot be replayed")
        return base.as_strided(t.size(), t.stride(), t.storage_offset())

    def run(self) -> None:
        for i, op in enumerate(self.tape):
            whole = op.args[0] if op.args and op.overwrites is not None else None

            def to_real(a: Any, whole: Any = whole) -> Any:
                return self._real(a, a is whole) if isinstance(a, torch.Tensor) else a

            args, kwargs = tree_map(to_real, (op.args, op.kwargs))
            out = op.func(*args, **kwargs)
            for meta_out, real_out in zip(op.outputs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)], strict=True):
                st = _storage(meta_out)
                if st not in self.real:  # a tensor the op made: its storage, whole
                    self.real[st] = real_out.as_strided((real_out.untyped_storage().nbytes() // real_out.element_size(),), (1,), 0)
            for st in self.free_after.get(i, ()):
                real = self.real.pop(st, None)
                if st in self.owners and real is not None and i == self.last[st]:
                    name, meta = self.owners[st]
                    self.keep(name, real.as_strided(meta.size(), meta.stride(), meta.storage_offset()))
