"""``auto_parallelize``: the one place that joins planning and running.

Outside a process group it plans and returns a :class:`PlanningResult` (the best plan, every
configuration tried, a readable report). Under ``torchrun`` with ``WORLD_SIZE == devices`` rank 0
plans, every rank receives that plan (so all ranks run the same one, whatever their solver did),
and each returns its runnable :class:`runtime.module.ParallelModule`. ``runtime`` is imported lazily, so planning never touches
``torch.distributed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from planner.config import SearchConfig
from planner.ir import IRGraph
from planner.plan import Plan
from planner.report import format_search
from planner.search import SearchProgress, SearchResult, search
from planner.trace import micro_batch_inputs, trace

if TYPE_CHECKING:
    from planner.runtime.module import ParallelModule


@dataclass(frozen=True)
class PlanningResult:
    """The chosen plan (the objective's point of the front), the whole search, its report."""

    plan: Plan | None
    search: SearchResult
    report: str
    graph: IRGraph | None = None

    @property
    def front(self) -> list[Plan]:
        """The time/memory Pareto front across every configuration searched, fastest first."""
        return self.search.front

    @property
    def knee(self) -> Plan | None:
        return self.search.knee

    def __str__(self) -> str:
        return self.report


def _world_size() -> int | None:
    import torch.distributed as dist  # only to ask whether a process group exists

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def plan_model(
    model: torch.nn.Module,
    *,
    devices: int | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    config: SearchConfig | str | None = None,
    model_name: str | None = None,
    progress: Callable[[SearchProgress], None] | None = None,
    workers: int | None = None,
    **config_fields: Any,
) -> PlanningResult:
    """Trace ``model`` on the example inputs (a full global batch), search every configuration's
    time/memory front and pick a point by ``objective``: ``"time"`` the fastest plan that fits,
    ``"memory"`` the smallest, ``"knee"`` the best balance (:func:`planner.front.knee`).

    What to search is one :class:`planner.config.SearchConfig`: ``config=`` (the value, or a TOML
    or JSON file of its keys, or a saved plan's JSON, whose search it repeats), or its fields as
    keywords (``devices=64, zero=(0, 1, 2, 3), memory_budget="40GiB", hardware="h100-80g"``); both
    together: the keywords win. Among them: ``front=False`` finds only each configuration's fastest
    plan (quicker; ``knee`` then picks among those); each scheme's field lists the values its
    dimension is searched with (``zero=(0, 1, 2, 3)``, ``micro_batches=(1, 2, 4)``:
    :class:`planner.config.SearchConfig`; each scheme's module in :mod:`planner.schemes` says what
    its values do); ``bucket_bytes``: the gradient sync's bucket size (DDP's 25 MiB by default;
    :mod:`planner.buckets`). Every plan returned carries the configuration
    (``plan.search_config``). ``workers``, ``progress``: see :func:`planner.search.search`.

    Mixed precision: hand the model in its compute dtype (``model.to(torch.bfloat16)``) and set
    ``master_dtype="float32"``; the optimizer then keeps float32 master weights and states."""
    if example_inputs is None and not example_kwargs:
        raise ValueError("example_inputs is required: a full (global) batch such that model(*example_inputs) returns the loss")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int)):
        raise TypeError(f"devices must be an int (the device count), got {devices!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers {workers!r} must be >= 1 or None")
    fields = config_fields | ({"devices": devices} if devices is not None else {})
    if isinstance(config, str):
        config = SearchConfig.load(config, **fields)
    elif config is not None:
        config = SearchConfig.build("plan_model's config and keywords", **(config.model_dump() | fields)) if fields else config
    else:
        if devices is None:
            raise ValueError("devices is required (e.g. plan_model(model, devices=64, example_inputs=batch)), or config=")
        config = SearchConfig.build("plan_model's keywords", **fields)
    t0 = time.perf_counter()
    graph = trace(model, tuple(example_inputs or ()), dict(example_kwargs or {}))
    trace_s = time.perf_counter() - t0
    name = model_name or type(model).__name__
    result = search(graph, config, model_name=name, progress=progress, workers=workers,
                    micro_graph=lambda m: trace(model, *micro_batch_inputs(tuple(example_inputs or ()), example_kwargs, m)))
    report = format_search(result, model_name=name, devices=config.devices, hardware=config.hardware, trace_seconds=trace_s, graph=graph, verbose=True)
    return PlanningResult(result.best, result, report, graph)


def auto_parallelize(
    model: torch.nn.Module,
    devices: int | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    plan: Plan | None = None,
    device: torch.device | str | None = None,
    weights: Any = None,
    init: Any = None,
    device_mesh: Any = None,
    **planning: Any,
) -> PlanningResult | ParallelModule:
    """Plan ``model`` for ``devices`` devices; under torchrun, return this rank's sharded module.

    ``example_inputs``/``example_kwargs``: one full global batch (``model(*example_inputs,
    **example_kwargs)`` returns the training loss). Keyword arguments of :func:`plan_model`
    (``hardware``, ``memory_budget``, ``tp``, ``zero``, ``cdp``, ``dp``, ``micro_batches``, ``objective`` = ``"time"``,
    ``"memory"`` or ``"knee"``, ...) pass through. ``model`` may live on the meta device: each rank
    then materialises only its shards (``init``: the initialisation to replay, ``weights``: a
    safetensors file or folder or a checkpoint to read them from instead; ``runtime.compile_plan``),
    on ``device_mesh`` if given (a torch DeviceMesh with the plan's axis names). Outside torchrun the :class:`PlanningResult`
    carries the chosen plan and the front (``.plan``, ``.front``, ``.knee``); under torchrun the
    module's ``.plan`` is the chosen point and ``.front`` the front, the same on every rank. Give
    ``plan=`` to run a saved plan without searching again.
    """
    world = _world_size()
    if devices is None:
        if world is None:
            raise ValueError("devices is required outside torchrun (e.g. auto_parallelize(model, devices=64, example_inputs=batch))")
        devices = world
    if world is not None and world != devices:
        raise ValueError(f"devices={devices} but WORLD_SIZE={world}: launch with torchrun --nproc-per-node {devices} (or plan for {world})")
    if world is None:
        if plan is not None:
            raise ValueError("plan= runs a saved plan, which needs torchrun (a process group); outside it, call without plan=")
        return plan_model(model, devices=devices, example_inputs=example_inputs, example_kwargs=example_kwargs, **planning)
    from planner.runtime.compile import compile_plan
    from planner.runtime.groups import agree_on_rank0

    if plan is None:

        def search_on_rank0() -> tuple[str | None, str, list[str]]:
            result = plan_model(model, devices=devices, example_inputs=example_inputs, example_kwargs=example_kwargs, **planning)
            return (result.plan.model_dump_json() if result.plan is not None else None), result.report, [p.model_dump_json() for p in result.front]

        text, report, front = agree_on_rank0(search_on_rank0)
        if text is None:
            raise ValueError(f"no plan fits; nothing to run.\n{report}")
        plan = Plan.model_validate_json(text)
        pm = compile_plan(plan, model, tuple(example_inputs or ()), dict(example_kwargs or {}), device=device, weights=weights, init=init,
                          device_mesh=device_mesh)
        pm.front = [Plan.model_validate_json(t) for t in front]  # every rank gets the front it was chosen from
        return pm
    return compile_plan(plan, model, tuple(example_inputs or ()), dict(example_kwargs or {}), device=device, weights=weights, init=init,
                        device_mesh=device_mesh)
