"""Checks that run inside gloo worker processes (see tests/harness.py).

``train_and_compare`` trains a tiny model (gpt-tiny, vit-tiny, mlp-tiny) in float64 for three SGD-momentum steps under each plan
and, in the same process, a single-device copy from the same initial weights on the same
batches, and reports per step: both losses, the largest gradient error (relative to the
parameter's largest gradient, floored at 1e-6 of the largest gradient of the model so that
parameters whose true gradient is ~0, like a key bias under softmax, do not divide by zero),
whether the collectives executed equal the plan's priced list, and at the end the largest
parameter error and whether the gathered initial state dict equalled the model's bit for bit.

Why SGD for gpt-tiny and AdamW only for gpt-tiny-nobias: the key projection's bias has a true gradient of zero (softmax is
invariant to adding the same q.b_k to every score), so both runs see ~1e-17 of rounding noise
there, and Adam's normalisation m / sqrt(v) turns any such noise into a full-size step of lr. The
parameters would then differ by ~lr for reasons that have nothing to do with parallelism.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

BATCH = 4
STEPS = 3
# precision name -> (compute dtype, master dtype or None); see tests/test_mixed_precision.py
PRECISIONS = {"fp64": (torch.float64, None), "fp32+master64": (torch.float32, torch.float64), "bf16+master32": (torch.bfloat16, torch.float32)}
_GRAPHS: dict[tuple[Any, ...], Any] = {}


def traced(name: str, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model`` (preset ``name``) traced on ``args, kwargs``: once per process for each preset,
    parameter dtype and device, and input shapes, whichever check asks (a rank compiles many plans
    of one model, each with a fresh instance of it; export takes 0.3-1.9 s a model here, and 4 or
    8 ranks share 2 cores)."""
    from torch.utils._pytree import tree_flatten

    from planner.trace import trace

    first = next(model.parameters())
    shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in tree_flatten((args, kwargs))[0])
    key = (name, first.dtype, first.device.type, shapes)
    if key not in _GRAPHS:
        _GRAPHS[key] = trace(model, args, kwargs)
    return _GRAPHS[key]


def build(name: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A preset of ``models``, or ``"package.module:SPEC"`` (a test model with ``build`` and ``inputs``)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr).build(dtype=dtype, seed=seed)  # type: ignore[no-any-return]
    from planner.models import build_model

    return build_model(name, dtype=dtype, seed=seed)


def build_native(name: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """Preset ``name`` constructed and initialised in ``dtype`` (not cast to it) on ``device``, after
    ``torch.manual_seed(0)``: on "meta" the model ``compile_plan`` materialises, on "cpu" its twin."""
    from planner.models import get_spec

    spec = get_spec(name)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = spec.build()
            model.reset_parameters()
    finally:
        torch.set_default_dtype(default)
    return model  # type: ignore[no-any-return]


def inputs(name: str, batch: int, dtype: torch.dtype, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr).inputs(batch=batch, dtype=dtype, seed=seed)  # type: ignore[no-any-return]
    from planner.models import example_inputs

    return example_inputs(name, batch=batch, dtype=dtype, seed=seed)


def _batches(model: str, n: int, dtype: torch.dtype = torch.float64) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [inputs(model, BATCH, dtype, seed=100 + i) for i in range(n)]


class _ReferenceMasters:
    """Single-device mixed precision written out plainly: ``master_dtype`` copies stepped by the
    optimizer, gradients cast up, parameters cast back down (the runtime's MasterWeights is not used)."""

    def __init__(self, ref: torch.nn.Module, opt_class: type[torch.optim.Optimizer], master_dtype: torch.dtype, **kwargs: Any) -> None:
        self.pairs = [(p, p.detach().to(master_dtype).clone().requires_grad_(True)) for p in ref.parameters()]
        self.opt = opt_class([m for _, m in self.pairs], **kwargs)

    def step(self) -> None:
        for p, m in self.pairs:
            m.grad = p.grad.to(m.dtype) if p.grad is not None else None
        self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m.to(p.dtype))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self.pairs:
            p.grad = m.grad = None


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest ``max|got - want| / max|want|`` over tensors, the denominator floored at 1e-6 of the
    largest value of any tensor (a tensor that should be ~0 is compared at the model's scale)."""
    floor = 1e-6 * max(t.abs().max().item() for t in want.values())
    return max((got[n] - t).abs().max().item() / max(t.abs().max().item(), floor) for n, t in want.items())


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _reference_run(name: str, dtype: torch.dtype, master_dtype: torch.dtype | None, optimizer: str, batches: list[Any], native: bool = False) -> dict[str, Any]:
    """One device's run of ``name`` on ``batches``: each step's loss and gradients (before the
    optimizer step), and the parameters after the last. ``native``: the model as :func:`build_native` makes it."""
    from planner.trace import loss_of

    opt_class, opt_kwargs = OPTIMIZERS[optimizer]
    ref = build_native(name, dtype) if native else build(name, dtype)
    ref_opt: Any = _ReferenceMasters(ref, opt_class, master_dtype, **opt_kwargs) if master_dtype else opt_class(ref.parameters(), **opt_kwargs)
    losses, grads = [], []
    for args, kwargs in batches:
        ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
        losses.append(ref_loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None})
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "params": {n: p.detach() for n, p in ref.named_parameters()}}


def train_and_compare(rank: int, world: int, plans_json: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    """For each (model preset, plan JSON[, optimizer[, precision[, start]]]): train both ways and
    report (module docstring). One device's run is made once per model, optimizer and precision,
    however many plans compare with it. ``start`` "meta": the sharded run compiles the model built
    on the meta device (:func:`build_native`; the plan made on its graph), each rank materialising
    its shards, against the same model built on one CPU."""
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan
    from planner.trace import micro_batch_inputs

    reports = []
    references: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
    for name, text, *rest in plans_json:
        optimizer = rest[0] if rest else "sgd"
        precision = rest[1] if len(rest) > 1 else "fp64"
        meta = len(rest) > 2 and rest[2] == "meta"
        opt_class, opt_kwargs = OPTIMIZERS[optimizer]
        dtype, master_dtype = PRECISIONS[precision]
        plan = Plan.model_validate_json(text)
        batches = _batches(name, STEPS, dtype)
        if (name, optimizer, precision, meta) not in references:
            references[(name, optimizer, precision, meta)] = _reference_run(name, dtype, master_dtype, optimizer, batches, native=meta)
        want = references[(name, optimizer, precision, meta)]
        model = build_native(name, dtype, "meta") if meta else build(name, dtype)
        args, kwargs = batches[0]
        graph = traced(name, model, *micro_batch_inputs(args, kwargs, plan.micro_batches))
        if meta:
            torch.manual_seed(0)  # as before the CPU twin's construction: the replayed draws are its draws
        pm = compile_plan(plan, model, args, kwargs, graph=graph)
        state = pm.full_state_dict()
        source = build_native(name, dtype) if meta else model
        exact_state = all(torch.equal(state[n], t) for n, t in source.named_parameters(remove_duplicate=False))
        opt = pm.make_optimizer(opt_class, **opt_kwargs)
        steps = []
        for k, (args, kwargs) in enumerate(batches):
            local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
            pm.recorder.records.clear()
            pm.recorder.enabled = True  # one whole step: forward, backward, optimizer step
            if plan.micro_batches > 1:  # gradient accumulation: the plan's micro-batches, one sync
                loss = pm.forward_backward(*local_args, **local_kwargs)
            else:
                loss = pm(*local_args, **local_kwargs)
                loss.backward()
            grads = pm.full_grads()
            opt.step()
            pm.recorder.enabled = False
            held = pm.held_bytes(opt)
            executed = pm.executed_comms()
            priced = plan.priced_comms()
            steps.append({
                "loss": loss.item(),
                "ref_loss": want["losses"][k],
                "grad_error": _relative_error(grads, want["grads"][k]),
                "comms_equal": executed == priced,
                "executed_not_priced": [[*list(k), v] for k, v in (executed - priced).items()],
                "priced_not_executed": [[*list(k), v] for k, v in (priced - executed).items()],
                "num_collectives": sum(executed.values()),
                "buckets": len(plan.grad_buckets),
                "buckets_started_in_backward": pm.buckets.started_in_backward if pm.buckets is not None else 0,
            })
            opt.zero_grad(set_to_none=True)
        final = pm.full_state_dict()
        param_error = _relative_error(final, want["params"])
        predicted = plan.memory_breakdown
        reports.append({
            "mesh": plan.mesh, "zero": plan.zero_stage, "steps": steps, "param_error": param_error, "exact_initial_state": exact_state,
            # gathers started ahead of use: outside ZeRO-3 units (graph nodes), and the units' in the last step
            "prefetched": sum(1 for n in pm.graph_module.graph.nodes if n.op == "call_module" and str(n.target).startswith("prefetch_"))
            + (pm.units.prefetched if pm.units is not None else 0),
            "units": len(plan.param_units),
            "held": held, "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer},
        })
    return reports


def measure_peak_memory(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each (model preset, plan JSON made for it in float32 with AdamW): one warm-up step (the
    optimizer's states appear), then the peak bytes of a step on this rank by the CPU allocator's
    events (tests/memory_probe.py), beside the plan's predicted peak and its breakdown.

    The smaller of two measured steps' peaks: gloo's worker thread lets go of a finished
    collective's tensors a moment after the caller has gone on, at a time that varies, so a step
    now and then counts one buffer twice (measured: HF Llama and Mistral under 1-D, rank 1, once
    in a few runs, +5,120 B: one activation of that model, 151,892 B against 146,772 B)."""
    from planner.plan import Plan
    from tests.memory_probe import peak_over

    out = []
    for name, text in cases:
        plan = Plan.model_validate_json(text)
        batches = _batches(name, 3, torch.float32)
        pm = _compiled_float32(name, plan, batches[0])
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        measured = (0, 0)
        for k, (args, kwargs) in enumerate(batches):
            local_args, local_kwargs = pm.shard_batch(*args, **kwargs)

            def step(pm: Any = pm, opt: Any = opt, local_args: Any = local_args, local_kwargs: Any = local_kwargs) -> None:
                pm(*local_args, **local_kwargs).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if k == 0:  # the warm-up, unmeasured
                step()
                continue
            held = [*pm.parameters(), *(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))]
            this = peak_over(step, held)
            measured = this if k == 1 else min(measured, this)
        out.append(_memory_row(plan, measured))
    return out


def measure_cdp_peak_memory(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """measure_peak_memory for CDP plans: each (model preset, CDP plan JSON made in float32 with
    AdamW) trained by runtime.cdp.CDPTrainer, whose step holds more than the module and the
    optimizer between steps (v1's pending summed gradient, ring buffers in flight): the bytes live
    at a step's start are every tensor the trainer holds then, found by walking its attributes.
    The two measured steps and the trainer's last messages run in one profiling session
    (tests.memory_probe.peaks_over_steps says why); the smaller peak, as measure_peak_memory."""
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from tests.memory_probe import peaks_over_steps

    out = []
    for name, text in cases:
        plan = Plan.model_validate_json(text)
        batches = _batches(name, 4, torch.float32)
        dp_axes = frozenset(plan.mesh_obj.active_dp_axes)
        pm = _compiled_float32(name, plan, batches[0], loss_partial_over=dp_axes)
        trainer = CDPTrainer(pm, torch.optim.AdamW, lr=1e-3)
        local = [pm.shard_batch(*args, **kwargs) for args, kwargs in batches]
        for a, kw in local[:2]:  # warm-up, unprofiled: the optimizer's states appear (v1 first steps at step 1)
            trainer.step(*a, **kw)
        steps = [functools.partial(trainer.step, *a, **kw) for a, kw in local[2:]]
        measured = min(peaks_over_steps(steps, functools.partial(_held_tensors, trainer), trainer.finish))
        out.append(_memory_row(plan, measured))
    return out


def _compiled_float32(name: str, plan: Any, batch: tuple[tuple[Any, ...], dict[str, Any]], **kwargs: Any) -> Any:
    """A fresh float32 ``name`` compiled under ``plan`` (its graph traced once, :func:`traced`)."""
    from planner.runtime.compile import compile_plan

    model = build(name, torch.float32)
    return compile_plan(plan, model, *batch, graph=traced(name, model, *batch), **kwargs)


def _memory_row(plan: Any, measured: tuple[int, int]) -> dict[str, Any]:
    """A memory check's report: the peak measured and the bytes live at its step's start, beside
    the plan's predicted peak and its breakdown."""
    m = plan.memory_breakdown
    return {"peak": measured[0], "start": measured[1], "predicted": plan.peak_memory_bytes,
            "breakdown": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations,
                          "transient": m.transient, "step_transient": m.step_transient}}


def _held_tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from ``root``'s attributes, containers and optimizer states (modules
    and optimizers included), each once."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = [root]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x)
            if x.grad is not None:
                stack.append(x.grad)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list | tuple | set):
            stack.extend(x)
        elif isinstance(x, torch.nn.Module):
            stack.extend(x.parameters())
            stack.extend(x.buffers())
        elif isinstance(x, torch.optim.Optimizer):
            stack.append(x.state)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith(("planner.runtime", "tests")):
            stack.append(vars(x))
    return found
