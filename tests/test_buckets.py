"""Gradient buckets (planner.buckets): packing, pricing, and the plan's record of them.

The runtime side (buckets all-reduced from gradient hooks while backward runs, the collectives
executed equal to the plan's, the same math as one device) is checked on gloo ranks in
tests/test_same_math.py.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from planner.buckets import Gradient, pack
from planner.config import SearchConfig
from planner.cost import comm_time
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import build_model, example_inputs
from planner.search import search
from planner.strategy import Comm
from planner.trace import trace

AXES = (("dp",), ("dp", "tp"))
SYNCS = ((("all_reduce", "step"),), (("reduce_scatter", "bwd"), ("all_gather", "step")))  # ZeRO-0; ZeRO-2

gradients = st.lists(
    st.builds(Gradient, param=st.uuids().map(str), nbytes=st.integers(1, 5000), axes=st.sampled_from(AXES),
              dtype=st.sampled_from(("float32", "bfloat16")), ready=st.integers(0, 100), collectives=st.sampled_from(SYNCS)),
    max_size=40, unique_by=lambda g: g.param,
)


@given(gradients, st.integers(1, 8000))
def test_every_gradient_is_in_exactly_one_bucket_of_its_axes_dtype_and_collectives(grads: list[Gradient], cap: int) -> None:
    buckets = pack(grads, cap)
    by_name = {g.param: g for g in grads}
    packed = [p for b in buckets for p in b.params]
    assert sorted(packed) == sorted(by_name)
    for b in buckets:
        members = [by_name[p] for p in b.params]
        assert {(g.axes, g.dtype, g.collectives) for g in members} == {(b.axes, b.dtype, b.collectives)}
        assert b.nbytes == sum(g.nbytes for g in members)
        assert b.nbytes <= cap or len(members) == 1  # over the cap only a gradient larger than a bucket, alone


@given(gradients, st.integers(1, 8000))
def test_buckets_fill_in_the_order_backward_produces_gradients(grads: list[Gradient], cap: int) -> None:
    """Within one (axes, dtype, collectives), bucket after bucket and inside each, the gradients come in
    backward's order (latest first use first), and no bucket could have taken its successor's first."""
    buckets = pack(grads, cap)
    by_name = {g.param: g for g in grads}
    for key in {(g.axes, g.dtype, g.collectives) for g in grads}:
        mine = [b for b in buckets if (b.axes, b.dtype, b.collectives) == key]
        readies = [by_name[p].ready for b in mine for p in b.params]
        assert readies == sorted(readies, reverse=True)
        for b, nxt in itertools.pairwise(mine):
            assert b.nbytes + by_name[nxt.params[0]].nbytes > cap


def test_bad_bucket_size_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        pack([], 0)


def test_a_packed_gradient_pays_its_share_of_one_buckets_latency() -> None:
    mesh = Mesh.from_dict({"dp": 4})
    cap = 1 << 20
    alone = comm_time(Comm("all_reduce", ("dp",), cap // 4, "step"), mesh, A100_80G)
    share = comm_time(Comm("all_reduce", ("dp",), cap // 4, "step", cap), mesh, A100_80G)
    full = comm_time(Comm("all_reduce", ("dp",), cap, "step", cap), mesh, A100_80G)
    latency = 2 * 3 * A100_80G.tier(False).latency  # ring all-reduce over 4: 2(n-1) steps
    assert alone - share == pytest.approx(latency * 3 / 4)
    assert full == pytest.approx(comm_time(Comm("all_reduce", ("dp",), cap, "step"), mesh, A100_80G))  # a whole bucket: all of it
    four = 4 * share
    assert four == pytest.approx(full)  # four quarter-bucket gradients cost what one full bucket does


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("bucket_bytes", [1 << 30, 16 * 1024])
def test_a_data_parallel_plan_lists_its_buckets_collectives_over_all_its_gradients(bucket_bytes: int, zero: int) -> None:
    """ZeRO-0: one all-reduce per bucket; ZeRO-1/2: a reduce-scatter (in backward for ZeRO-2) and
    an all-gather per bucket, beside an all-reduce bucket for what does not split 4 ways."""
    model = build_model("gpt-tiny", dtype=torch.float32)
    args, kwargs = example_inputs("gpt-tiny", batch=4, dtype=torch.float32)
    graph = trace(model, args, kwargs)
    space = SearchConfig(devices=4, dp=4, tp=("none",), zero=(zero,), front=False, bucket_bytes=bucket_bytes)
    plan = search(graph, space, model_name="gpt-tiny").best
    assert plan is not None and plan.grad_bucket_bytes == bucket_bytes and plan.zero_stage == zero
    params = {n.name: n for n in graph.nodes.values() if n.kind == "param"}
    assert sorted(p for b in plan.grad_buckets for p in b.params) == sorted(params)
    assert sum(b.nbytes for b in plan.grad_buckets) == sum(n.out.nbytes for n in params.values())
    synced = Counter({(c.kind, c.axes, c.nbytes, c.phase): c.count for c in plan.comms if c.bucket_bytes})
    assert synced == Counter((k, b.axes, b.nbytes, p) for b in plan.grad_buckets for k, p in b.collectives)
    assert {c.phase for c in plan.comms if not c.bucket_bytes} <= {"fwd", "bwd"}  # nothing synced one parameter at a time
    if zero:
        assert any(b.collectives[0] == ("reduce_scatter", "bwd" if zero == 2 else "step") for b in plan.grad_buckets)
    if bucket_bytes < sum(b.nbytes for b in plan.grad_buckets):
        assert len(plan.grad_buckets) > 2
    else:
        assert len(plan.grad_buckets) == len({b.collectives for b in plan.grad_buckets})  # one per kind of sync
