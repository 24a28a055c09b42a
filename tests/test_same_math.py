"""Same math and priced = executed, on gloo: tiny models in float64 on 2, 4 and 8 ranks.

Each world size is spawned once; inside, every plan (gpt-tiny unless named) trains three
optimizer steps beside a single-device run (SGD with momentum; see tests/dist_checks.py for why
not AdamW). Plans: data parallel, Megatron 1-D tensor parallel (column/row linears,
vocab-parallel embedding and loss), the ILP's most memory-frugal plan (it picks
sequence-parallel layouts), and their combinations with dp=2; 2-D (SUMMA, all-gather form) on
2x2 and dp=2 x 2x2, and 3-D on the 2x2x2 cube (the ILP's least-memory plans on those meshes,
checked to use the family). Two plans on 4 ranks start from the model built on the meta device
(each rank materialises its shards, runtime.materialize) against the same model built on a CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from planner.config import SearchConfig
from planner.ir import Node
from planner.models import build_model, example_inputs
from planner.schemes.recompute import parse
from planner.search import search
from planner.strategy import Strategy
from planner.trace import trace
from tests.dist_checks import BATCH, build_native, train_and_compare
from tests.harness import map_in_workers, run_world

HEAVY = ("aten.linear.default", "aten.layer_norm.default", "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default")
COL = ("q_proj", "k_proj", "v_proj", "fc", "lm_head")
ROW = ("out_proj", "proj")


def data_parallel(node: Node, s: Strategy) -> bool:
    """Every heavy op splits the batch over dp (meshes here always have dp > 1 when this is used)."""
    return node.target not in HEAVY or "dp" in s.split_axes


def megatron(node: Node, s: Strategy) -> bool:
    """Megatron-LM's 1-D layout: q/k/v/fc column-parallel, out/proj row-parallel, vocab-parallel
    embedding and loss, LayerNorm replicated over tp."""
    last = node.module_path.rsplit(".", 1)[-1]
    if node.target == "aten.linear.default":
        if last in COL:
            return s.algorithm.startswith("tp1d-col")
        if last in ROW:
            return s.algorithm.startswith("tp1d-row")
    if node.target == "aten.layer_norm.default":
        return "tp" not in s.split_axes
    if node.target == "aten.embedding.default" and node.module_path == "wte":
        return s.algorithm.startswith("vocab-parallel")
    if node.target == "aten.cross_entropy_loss.default":
        return s.algorithm.startswith("vocab-parallel")
    return True


def _plan(
    devices: int, dp: int, *, model: str = "gpt-tiny", allow: Any = None, objective: str = "time", family: str = "1d", bucket_bytes: int | None = None,
    zero: int = 0, start: str = "cpu", recompute: str = "none",
) -> tuple[str, ...]:
    """(model, plan JSON[, optimizer, precision, start]) for tests.dist_checks.train_and_compare;
    ``start="meta"``: planned on the model built on the meta device, which the ranks materialise;
    ``"plan-on-meta"``: planned on the meta device (as `planner report --save-plan` plans), the
    ranks build the model for real; ``"meta-from-cpu-plan"``: the other way round. A trace on meta
    has an ``aten.contiguous`` the one on CPU drops (planner.plan.fingerprint)."""
    if start == "meta":
        module = build_native(model, torch.float64, "meta")
    else:
        module = build_model(model, dtype=torch.float64, device="meta" if start == "plan-on-meta" else "cpu")
    args, kwargs = example_inputs(model, batch=BATCH, dtype=torch.float64, device="meta" if start == "plan-on-meta" else "cpu")
    graph = trace(module, args, kwargs)
    buckets = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
    mode, share = parse(recompute)  # "full 1/2": the first half of the blocks
    config = SearchConfig(devices=devices, dp=dp, tp=(family,) if devices > dp else ("none",), zero=(zero,), recompute=(mode,),  # type: ignore[arg-type]
                          recompute_layers=(float(share),), objective=objective, front=False, **buckets)
    result = search(graph, config, model_name=model, allow=allow)
    assert result.best is not None
    if devices > dp:
        assert result.best.tp == family, (family, result.best.tp)
    assert result.best.zero_stage == zero
    assert result.best.recompute == recompute
    if start in ("meta", "meta-from-cpu-plan"):
        return model, result.best.model_dump_json(), "sgd", "fp64", "meta"
    return model, result.best.model_dump_json()


def summa(node: Node, s: Strategy) -> bool:
    """Every block linear runs SUMMA's q broadcast steps (2-D's stepped variant)."""
    if node.target == "aten.linear.default" and node.module_path.startswith("h."):
        return s.kernel == "summa"
    return True


def regathering(node: Node, s: Strategy) -> bool:
    """Every block linear gathers its inputs itself and again in backward (3-D's low-memory variant)."""
    if node.target == "aten.linear.default" and node.module_path.startswith("h."):
        return s.algorithm.endswith("+regather")
    return True


def weight_regathering(node: Node, s: Strategy) -> bool:
    """Every block linear gathers its weight over a tensor-parallel axis itself: under ZeRO-3 the
    weight first reaches it through a unit's all-gather over dp on the edge (stored split over dp)."""
    if node.target == "aten.linear.default" and node.module_path.startswith("h."):
        return s.algorithm.endswith("+regather") and 1 in dict(s.regather)
    return True


def megatron_dp(node: Node, s: Strategy) -> bool:
    """Megatron with the batch split over dp everywhere."""
    return megatron(node, s) and data_parallel(node, s)


SMALL_BUCKETS = 16 * 1024  # gpt-tiny's gradients fill several: the sync overlaps backward bucket by bucket

CASES = {
    2: {
        "dp=2": dict(dp=2, allow=data_parallel),
        "dp=2 in 16 KiB buckets": dict(dp=2, allow=data_parallel, bucket_bytes=SMALL_BUCKETS),
        "tp=2 megatron": dict(dp=1, allow=megatron),
        "tp=2 least-memory": dict(dp=1, objective="memory"),
        "vit-tiny tp=2 least-memory": dict(dp=1, model="vit-tiny", objective="memory"),
        "mlp-tiny tp=2 megatron": dict(dp=1, model="mlp-tiny", allow=megatron),
        "tp=2 megatron planned on meta, run on the CPU model": dict(dp=1, allow=megatron, start="plan-on-meta"),
        "tp=2 megatron planned on the CPU model, run from meta": dict(dp=1, allow=megatron, start="meta-from-cpu-plan"),
        "dp=2 recomputing every block": dict(dp=2, allow=data_parallel, recompute="full"),
        "tp=2 megatron recomputing every block": dict(dp=1, allow=megatron, recompute="full"),
        "dp=2 recomputing the first block": dict(dp=2, allow=data_parallel, recompute="full 1/2"),
        "tp=2 megatron recomputing the first block": dict(dp=1, allow=megatron, recompute="full 1/2"),
    },
    4: {
        "dp=2 x tp=2 megatron": dict(dp=2, allow=megatron_dp),
        "dp=2 x tp=2 least-memory": dict(dp=2, objective="memory"),
        "tp=4 megatron": dict(dp=1, allow=megatron),
        "2-D 2x2 least-memory": dict(dp=1, family="2d", objective="memory"),
        "2-D 2x2 SUMMA stepped broadcasts": dict(dp=1, family="2d", allow=summa),
        "tp=4 megatron from meta": dict(dp=1, allow=megatron, start="meta"),
        "dp=4 ZeRO-3 least-memory from meta": dict(dp=4, zero=3, objective="memory", start="meta"),
        "dp=2 x tp=2 ZeRO-1 least-memory recomputing every block": dict(dp=2, zero=1, objective="memory", recompute="full"),
    },
    8: {
        "3-D 2x2x2 least-memory": dict(dp=1, family="3d", objective="memory"),
        "3-D 2x2x2 re-gathering": dict(dp=1, family="3d", allow=regathering),
        "dp=2 x 2-D 2x2 least-memory": dict(dp=2, family="2d", objective="memory"),
        "dp=2 x 2-D 2x2 ZeRO-3, weights re-gathered over tp": dict(dp=2, family="2d", zero=3, allow=weight_regathering),
        "3-D 2x2x2 least-memory recomputing every block": dict(dp=1, family="3d", objective="memory", recompute="full"),
        "3-D 2x2x2 least-memory recomputing the first block": dict(dp=1, family="3d", objective="memory", recompute="full 1/2"),
    },
}


def _case_plan(world: int, name: str) -> tuple[str, ...]:
    return _plan(world, **CASES[world][name])  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(CASES))
def world_results(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """Each world's plans are made by two processes at once: the least-memory plans on the 2-D and
    3-D meshes take 20-44 s each (most of that the fastest plan at the least memory, planner.solve),
    most of the 8-rank world's time."""
    world = request.param
    names = list(CASES[world])
    plans = map_in_workers(_case_plan, [world] * len(names), names)
    per_rank = run_world(world, train_and_compare, plans, timeout=900)
    return world, {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


def _all_steps(results: dict[str, list[dict[str, Any]]]):  # type: ignore[no-untyped-def]
    for name, ranks in results.items():
        for rank, rep in enumerate(ranks):
            for k, step in enumerate(rep["steps"]):
                yield name, rank, k, step


def test_loss_equals_single_device_to_1e_9(world_results):  # type: ignore[no-untyped-def]
    _, results = world_results
    for name, rank, k, step in _all_steps(results):
        assert abs(step["loss"] - step["ref_loss"]) <= 1e-9 * abs(step["ref_loss"]), (name, rank, k, step)


def test_every_gradient_equals_single_device_to_1e_9(world_results):  # type: ignore[no-untyped-def]
    _, results = world_results
    for name, rank, k, step in _all_steps(results):
        assert step["grad_error"] <= 1e-9, (name, rank, k, step["grad_error"])


def test_parameters_after_three_optimizer_steps_equal_single_device(world_results):  # type: ignore[no-untyped-def]
    _, results = world_results
    for name, ranks in results.items():
        for rank, rep in enumerate(ranks):
            assert len(rep["steps"]) == 3
            assert rep["param_error"] <= 1e-9, (name, rank, rep["param_error"])


def test_collectives_executed_equal_collectives_priced(world_results):  # type: ignore[no-untyped-def]
    _, results = world_results
    for name, rank, k, step in _all_steps(results):
        assert step["comms_equal"], (name, rank, k, step["executed_not_priced"], step["priced_not_executed"])
        assert step["num_collectives"] > 0, (name, rank, k)


def test_gradient_buckets_start_while_backward_runs(world_results):  # type: ignore[no-untyped-def]
    """Every bucket of a data-parallel plan is all-reduced from the hook of its last gradient,
    before backward ends (the collectives test above checks they are the plan's, one per bucket)."""
    world, results = world_results
    if world != 2:
        pytest.skip("checked on the 2-rank world")
    for name in ("dp=2", "dp=2 in 16 KiB buckets"):
        for _, rank, k, step in _all_steps({name: results[name]}):
            assert step["buckets"] >= (3 if "KiB" in name else 1), (name, step["buckets"])
            assert step["buckets_started_in_backward"] == step["buckets"], (name, rank, k, step)


def test_sharded_parameters_gather_back_to_the_model_exactly(world_results):  # type: ignore[no-untyped-def]
    _, results = world_results
    for name, ranks in results.items():
        assert all(rep["exact_initial_state"] for rep in ranks), name
