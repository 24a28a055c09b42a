"""CDP checks that run inside gloo worker processes (see tests/test_cdp.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

STEPS = 5
BATCH = 8
SGD: dict[str, Any] = {"lr": 0.1, "momentum": 0.9}


def _batches(name: str, batch: int = BATCH) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    from planner.models import example_inputs

    return [example_inputs(name, batch=batch, dtype=torch.float64, seed=300 + i) for i in range(STEPS)]


def _micro(batch: tuple[tuple[Any, ...], dict[str, Any]], n: int, workers: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = batch
    return tuple(a.chunk(workers)[n] for a in args), {k: v.chunk(workers)[n] for k, v in kwargs.items()}


def reference(name: str, rule: str, workers: int, num_stages: int, stage_of: dict[str, int], batch: int = BATCH,
              native: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The update rule run serially in one process on the unsharded model: the N micro-batches one
    after another, gradients summed in worker order, the rule applied as runtime/cdp.py states it.
    ``native``: the model initialised in float64 (tests.dist_checks.build_native), the CPU twin
    of one built on meta."""
    from planner.models import build_model
    from planner.trace import loss_of
    from tests.dist_checks import build_native

    model = build_native(name, torch.float64) if native else build_model(name, dtype=torch.float64, seed=0)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), **SGD)
    old: dict[str, torch.Tensor] | None = None
    previous: dict[str, torch.Tensor] | None = None
    losses = []
    for batch_inputs in _batches(name, batch):
        total: dict[str, torch.Tensor] = {}
        loss_sum = 0.0
        for n in range(workers):
            fresh = {}
            if rule == "v2" and old is not None:
                with torch.no_grad():
                    for pname, p in params.items():
                        if stage_of[pname] * workers < (workers - 1 - n) * num_stages:
                            fresh[pname] = p.detach().clone()
                            p.copy_(old[pname])
            args, kwargs = _micro(batch_inputs, n, workers)
            loss = loss_of(model(*args, **kwargs)) / workers
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (pname, p), g in zip(params.items(), grads, strict=True):
                g = g if g is not None else torch.zeros_like(p)
                total[pname] = g if pname not in total else total[pname] + g
            loss_sum += loss.item()
            with torch.no_grad():
                for pname, value in fresh.items():
                    params[pname].copy_(value)
        losses.append(loss_sum)
        if rule == "v2":
            old = {k: p.detach().clone() for k, p in params.items()}
        use = previous if rule == "v1" else total
        if use is not None:
            for pname, p in params.items():
                p.grad = use[pname].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        previous = total
    return losses, {k: p.detach().clone() for k, p in params.items()}


def cdp_train(rank: int, world: int, cases: list[tuple[str, str, str, int]]) -> list[dict[str, Any]]:
    """For each (model, plan JSON, rule, L): 5 CDP steps; reports losses, final parameters' error
    against the serial reference (rank 0 computes it), the messages this rank sent, and the
    collectives it issued. ``rule == "dp"`` trains the plan as ordinary DP (the baseline)."""
    import torch.distributed as dist

    from planner.models import build_model
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan
    from planner.trace import micro_batch_inputs
    from tests.dist_checks import traced

    out = []
    for name, text, rule, num_stages in cases:  # rule "plan": the CDP mode the plan was made with
        plan = Plan.model_validate_json(text)
        batches = _batches(name)
        model = build_model(name, dtype=torch.float64, seed=0)
        dp_axes = frozenset(plan.mesh_obj.active_dp_axes)
        report: dict[str, Any] = {"rule": rule}
        graph = traced(name, model, *micro_batch_inputs(*batches[0], plan.micro_batches))
        if rule == "dp":
            pm = compile_plan(plan, model, *batches[0], graph=graph)
            opt = torch.optim.SGD(pm.parameters(), **SGD)
            losses = []
            for args, kwargs in batches:
                a, k = pm.shard_batch(*args, **kwargs)
                loss = pm(*a, **k)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            report |= {"losses": losses, "params": {k: v.tolist() for k, v in pm.full_state_dict().items()}}
            out.append(report)
            continue
        pm = compile_plan(plan, model, *batches[0], loss_partial_over=dp_axes, graph=graph)
        if rule == "plan":  # the plan's own CDP mode and stage count
            trainer = CDPTrainer(pm, torch.optim.SGD, **SGD)
        else:
            trainer = CDPTrainer(pm, torch.optim.SGD, num_stages=num_stages, rule=rule, **SGD)  # type: ignore[arg-type]
        pm.recorder.records.clear()
        pm.recorder.enabled = True
        trainer.trace = True
        local_losses, between, params_between = [], [], []
        for args, kwargs in batches:
            local_losses.append(trainer.step(*pm.shard_batch(*args, **kwargs)[0], **pm.shard_batch(*args, **kwargs)[1]))
            between.append(trainer.message_bytes())
            params_between.append(trainer.held_bytes()["params"])
        trainer.finish()
        pm.recorder.enabled = False
        report["held"] = trainer.held_bytes()
        report["between"] = between  # message buffers held after each step
        report["params_between"] = params_between  # parameter bytes held after each step (ZeRO-3: none)
        report["full_params"] = sum(p.numel() * p.element_size() for p in trainer.params.values())
        report["predicted"] = {"params": plan.memory_breakdown.params, "optimizer": plan.memory_breakdown.optimizer,
                               "grads": plan.memory_breakdown.grads}
        executed = Counter((kind, axes) for kind, axes, _, _ in pm.recorder.records)
        summed = torch.tensor(local_losses, dtype=torch.float64)
        dist.all_reduce(summed, group=pm.mesh_groups.group(tuple(dp_axes)))
        stage_of = {n: trainer.runner.param_stage[attr] for attr, names in pm.param_names.items() for n in names}
        final = pm.full_state_dict()
        sends = Counter((kind, axes, nbytes) for kind, axes, nbytes, _ in pm.recorder.records if kind == "send")
        # ZeRO-3: a version's fetches for the steps after the last, sent before the last step knew it was the last, are
        # taken and dropped by finish(); they are not the steps' traffic
        sends -= Counter(("send", tuple(sorted(dp_axes)), nbytes) for _, _, m, nbytes in trainer.sent if m.kind in ("fetch", "refetch") and m.step >= STEPS)
        priced = Counter({(k, a, b): c * STEPS for (k, a, b, _), c in plan.priced_comms().items() if k == "send"})
        report |= {
            "sends_equal_priced": sends == priced,
            "sends": sorted([*k, c] for k, c in sends.items()),
            "priced_sends": sorted([*k, c] for k, c in priced.items()),
            "losses": summed.tolist(),
            "params": {k: v.tolist() for k, v in final.items()},
            "messages": trainer.messages,
            "dp_collectives": sum(c for (kind, axes), c in executed.items() if kind != "send" and set(axes) & dp_axes),
            "dp_collective_bytes": sorted({nbytes for kind, axes, nbytes, _ in pm.recorder.records if kind != "send" and set(axes) & dp_axes}),
            "sends_recorded": executed[("send", tuple(sorted(dp_axes)))],
            "stages": trainer.num_stages,
            "param_stages": [st for st in range(trainer.num_stages) if trainer.runner.stage_params[st]],
            "workers": trainer.num_workers,
            "worker": trainer.worker,
            "trainer_rule": trainer.rule,
            "owners": list(trainer.owners),
            "parts": list(trainer.units.parts),
            "hold": trainer.hold,
            "star": trainer.star,
            "reads": [list(r) for r in trainer.reads],
            "fetch": trainer.fetch,
            "has_params": [bool(a) for a in trainer.runner.stage_params],
            "ops": trainer.ops,
            "sent": [(op, tuple(dataclasses.astuple(m)), nbytes) for op, _, m, nbytes in trainer.sent],
        }
        if rank == 0:
            ref_losses, ref_params = reference(name, trainer.rule, trainer.num_workers, trainer.num_stages, stage_of)
            scale = max(v.abs().max().item() for v in ref_params.values())
            report["ref_losses"] = ref_losses
            report["param_error"] = max((final[k] - v).abs().max().item() for k, v in ref_params.items()) / scale
        out.append(report)
    return out


def cdp_memory(rank: int, world: int, name: str, text: str, num_stages: int) -> dict[str, Any]:
    """Runs N = 4 micro-batches through the stages in one process on CDP's clock (delta =
    2L/N) and on DP's (delta = 0) (every rank does the same, alone), measuring live saved-for-backward bytes per time unit, and each
    stage's A_l for one micro-batch."""
    from planner.models import build_model
    from planner.plan import Plan
    from planner.runtime.cdp import simulate_schedule
    from planner.runtime.compile import compile_plan
    from planner.runtime.memory import SavedTensorMeter
    from planner.runtime.stages import StagedRunner
    from planner.stages import cut_stages

    plan = Plan.model_validate_json(text)
    batch = _batches(name)[0]
    dp_axes = frozenset(plan.mesh_obj.active_dp_axes)
    pm = compile_plan(plan, build_model(name, dtype=torch.float64, seed=0), *batch, loss_partial_over=dp_axes)
    runner = StagedRunner(pm, cut_stages(pm.graph, num_stages))
    workers = 4
    micro = []
    for n in range(workers):
        args, kwargs = _micro(batch, n, workers)
        micro.append(tuple(t for t in (*args, *kwargs.values())))
    meter = SavedTensorMeter([*pm.local_parameters().values(), *(t for mb in micro for t in mb)])
    mb = runner.start(*micro[0])
    per_stage, before = [], 0
    for stage in range(num_stages):
        with meter.hooks():
            runner.forward(mb, stage)
        meter.track_all(runner.crossing(mb, stage))
        now = meter.live_bytes()
        per_stage.append(now - before)
        before = now
    for stage in reversed(range(num_stages)):
        runner.backward(mb, stage)
    del mb
    delta = 2 * num_stages // workers
    return {
        "A": per_stage,
        "after_release": meter.live_bytes(),
        "cdp": simulate_schedule(runner, micro, delta=delta, steps=3),
        "dp": simulate_schedule(runner, micro, delta=0, steps=3),
        "delta": delta,
    }


def cdp_pipeline(rank: int, world: int, cases: list[tuple[str, str, str, int, int, int, bool]]) -> list[dict[str, Any]]:
    """CDP with model parallelism, for each (model, one-device plan JSON, rule, N workers, L stages,
    global batch, from meta): L*ceil(N/L) = 4 ranks, 5 steps; rank 0 also runs the serial reference
    of the rule. From meta (runtime.cdp_pipeline.CDPPipeline.build), each rank materialises only its
    stage's parameters: ``held`` counts the parameter elements its module holds off the meta device."""
    import torch.distributed as dist

    from planner.models import build_model
    from planner.plan import Plan
    from planner.runtime.cdp_pipeline import CDPPipeline
    from planner.runtime.compile import compile_plan
    from planner.runtime.groups import MeshGroups
    from tests.dist_checks import build_native

    out = []
    for name, plan_json, rule, workers, num_stages, batch, meta in cases:
        plan = Plan.model_validate_json(plan_json)
        batches = _batches(name, batch)
        options: dict[str, Any] = {"num_workers": workers, "num_stages": num_stages, "rule": rule, "optimizer_class": torch.optim.SGD, **SGD}
        if meta:
            model = build_native(name, torch.float64, "meta")
            torch.manual_seed(0)  # as before the CPU twin's construction: the replayed draws are its draws
            pipe = CDPPipeline.build(plan, model, *_micro(batches[0], 0, workers), **options)
        else:
            mesh = plan.mesh_obj
            one = MeshGroups(mesh, 0, mesh.coords(0))  # the single-device plan runs on this rank alone
            pm = compile_plan(plan, build_model(name, dtype=torch.float64, seed=0), *_micro(batches[0], 0, workers), mesh_groups=one)
            pipe = CDPPipeline(pm, **options)
        pm = pipe.pm
        held = sum(p.numel() for p in pm.graph_module.parameters() if not p.is_meta)
        stage_elements = sum(m.numel() for m in pipe.masters.values())
        losses = torch.tensor(pipe.run(batches), dtype=torch.float64)
        dist.all_reduce(losses)
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, {k: v.tolist() for k, v in pipe.stage_state().items()})
        report: dict[str, Any] = {"losses": losses.tolist(), "messages": pipe.messages, "stage": pipe.stage, "held": held,
                                  "stage_elements": stage_elements, "meta": meta}
        if rank == 0:
            final = {k: torch.tensor(v, dtype=torch.float64) for part in parts for k, v in part.items()}
            stage_of = {n: pipe.runner.param_stage[attr] for attr, names in pm.param_names.items() for n in names}
            ref_losses, ref_params = reference(name, rule, workers, num_stages, stage_of, batch, native=meta)
            scale = max(v.abs().max().item() for v in ref_params.values())
            report["ref_losses"] = ref_losses
            report["param_error"] = max((final[k] - v).abs().max().item() for k, v in ref_params.items() if k in final) / scale
            report["covered"] = sorted(final) == sorted(k for k in ref_params if k in final) and len(final) == len(ref_params)
            report["total_elements"] = sum(v.numel() for v in ref_params.values())
        out.append(report)
    return out


def cdp_barred(rank: int, world: int, name: str, text: str) -> str:
    """CDPTrainer (v1, 2 stages) on a plan that all-reduces over the workers inside backward: the
    error CDPTrainer raises (nothing raised: "")."""
    from planner.models import build_model
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan

    plan = Plan.model_validate_json(text)
    args, kwargs = _batches(name)[0]
    pm = compile_plan(plan, build_model(name, dtype=torch.float64, seed=0), args, kwargs, loss_partial_over=frozenset(plan.mesh_obj.active_dp_axes))
    try:
        CDPTrainer(pm, torch.optim.SGD, rule="v1", num_stages=2, **SGD)
    except ValueError as exc:
        return str(exc)
    return ""
