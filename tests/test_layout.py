"""Specification of :mod:`planner.layout`: layouts, specs and the steps that convert between them.

The core check is a single-process simulator: every rank's local tensor is held at once, each
conversion step is applied to all of them with the collective's meaning, and the result must be
exactly the destination layout's local tensors of the same global tensor.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.layout import (
    Layout,
    Spec,
    Step,
    conversion_steps,
    parse_layout,
    parse_spec,
    spec_conversion,
    step_bytes,
)
from planner.mesh import Mesh
from planner.strategy import enumerate_layouts

# --------------------------------------------------------------------------- the simulator

Locals = dict[int, np.ndarray]


def _index_on(mesh: Mesh, rank: int, axes: tuple[str, ...]) -> int:
    """The rank's chunk index over ``axes``, the first axis outermost (row-major)."""
    c = mesh.coords(rank)
    idx = 0
    for a in axes:
        idx = idx * mesh.degree(a) + c[a]
    return idx


def shard(value: np.ndarray, layout: Layout, mesh: Mesh, rank: int) -> np.ndarray:
    """The rank's shard of ``value``: each dim chunked by its axes, the first axis outermost."""
    index = []
    for d, axes in enumerate(layout.dims):
        n = mesh.group_size(axes)
        size = value.shape[d] // n
        i = _index_on(mesh, rank, axes)
        index.append(slice(i * size, (i + 1) * size))
    return value[tuple(index)].copy()


def scatter(value: np.ndarray, layout: Layout, mesh: Mesh, rng: np.random.Generator) -> Locals:
    """Every rank's local tensor of ``value`` in ``layout``; partial axes split it into random addends."""
    out = {r: shard(value, layout, mesh, r) for r in range(mesh.size)}
    if layout.partial:
        for group in mesh.groups(tuple(layout.partial)):
            whole = out[group[0]]
            assert all(np.array_equal(out[r], whole) for r in group)  # partial axes are not shard axes
            addends = [rng.integers(-50, 50, size=whole.shape) for _ in group[1:]]
            out[group[0]] = whole - sum(addends, np.zeros_like(whole))
            for r, a in zip(group[1:], addends, strict=True):
                out[r] = a
    return out


def apply_step(step: Step, local: Locals, mesh: Mesh) -> Locals:
    out = dict(local)
    for group in mesh.groups(step.axes):
        n = len(group)
        if step.kind == "all_reduce":
            total = sum((local[r] for r in group), np.zeros_like(local[group[0]]))
            for r in group:
                out[r] = total.copy()
        elif step.kind == "all_gather":
            gathered = np.concatenate([local[r] for r in group], axis=step.dim)
            for r in group:
                out[r] = gathered.copy()
        elif step.kind == "reduce_scatter":
            total = sum((local[r] for r in group), np.zeros_like(local[group[0]]))
            for i, r in enumerate(group):
                out[r] = np.split(total, n, axis=step.dim)[i]
        elif step.kind == "slice":
            for i, r in enumerate(group):
                out[r] = np.split(local[r], n, axis=step.dim)[i]
        elif step.kind == "zero":
            for i, r in enumerate(group):
                out[r] = local[r].copy() if i == 0 else np.zeros_like(local[r])
        else:  # pragma: no cover - a step kind the simulator does not know
            raise AssertionError(f"unknown step kind {step.kind}")
    return out


def assert_holds(local: Locals, value: np.ndarray, layout: Layout, mesh: Mesh) -> None:
    """``local`` is ``value`` in ``layout``: shards exactly, partial groups summing to the shard."""
    want_shape = layout.local_shape(value.shape, mesh)
    for r in range(mesh.size):
        assert local[r].shape == want_shape, f"rank {r}: shape {local[r].shape}, want {want_shape}"
    for group in mesh.groups(tuple(layout.partial)):
        total = sum((local[r] for r in group), np.zeros(want_shape, dtype=value.dtype))
        for r in group:
            np.testing.assert_array_equal(total, shard(value, layout, mesh, r), err_msg=f"rank {r} group {group}")


def simulate(src: Layout, dst: Layout, mesh: Mesh, value: np.ndarray, seed: int = 0) -> tuple[Step, ...]:
    """Run ``conversion_steps(src, dst)`` on all ranks; check the result and the byte accounting."""
    rng = np.random.default_rng(seed)
    local = scatter(value, src, mesh, rng)
    assert_holds(local, value, src, mesh)  # the simulator's own encoding is right
    steps = conversion_steps(src, dst, mesh)
    nbytes = local[0].nbytes
    for step in steps:
        if step.kind in ("all_gather", "reduce_scatter", "slice"):
            assert step.dim is not None and len(step.axes) == 1, step
        else:
            assert step.dim is None, step
        assert step.axes == mesh.sort_axes(step.axes), step
        local = apply_step(step, local, mesh)
        _, nbytes = step_bytes(step, nbytes, mesh)
        assert all(t.nbytes == nbytes for t in local.values()), (step, nbytes)
    assert_holds(local, value, dst, mesh)
    return steps


# --------------------------------------------------------------------------- hypothesis inputs

AXES = ("dp", "tp", "x")


@st.composite
def meshes(draw: st.DrawFn) -> Mesh:
    names = draw(st.permutations(AXES))
    n = draw(st.integers(1, 3))
    degrees = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n).filter(lambda ds: math.prod(ds) <= 12))
    return Mesh(tuple(names[:n]), tuple(degrees))


@st.composite
def shapes(draw: st.DrawFn, mesh: Mesh) -> tuple[int, ...]:
    ndim = draw(st.integers(0, 3))
    sizes = sorted({1, 2, 3, 4, 6, mesh.size})
    return tuple(draw(st.lists(st.sampled_from(sizes), min_size=ndim, max_size=ndim)))


def _with_partial(draw: st.DrawFn, layout: Layout, mesh: Mesh) -> Layout:
    free = sorted(layout.replicated_axes(mesh))
    return layout.with_partial(frozenset(draw(st.lists(st.sampled_from(free), unique=True)) if free else ()))


@st.composite
def conversions(draw: st.DrawFn) -> tuple[Mesh, tuple[int, ...], Layout, Layout]:
    """A mesh, a shape, and src/dst from ``enumerate_layouts`` plus random partial axes."""
    mesh = draw(meshes())
    shape = draw(shapes(mesh))
    candidates = enumerate_layouts(shape, mesh)
    src = _with_partial(draw, draw(st.sampled_from(candidates)), mesh)
    dst = _with_partial(draw, draw(st.sampled_from(candidates)), mesh)
    return mesh, shape, src, dst


@st.composite
def general_layouts(draw: st.DrawFn, mesh: Mesh, shape: tuple[int, ...]) -> Layout:
    """Any layout: each axis (degree-1 ones too) shards any dim, is partial, or is replicated;
    the axes of a dim in any order."""
    dims: list[list[str]] = [[] for _ in shape]
    partial = []
    for axis in mesh.axes:
        role = draw(st.sampled_from(["replicated", "partial", *range(len(shape))]))
        if role == "partial":
            partial.append(axis)
        elif role != "replicated":
            dims[role].append(axis)  # type: ignore[index]
    dims = [draw(st.permutations(d)) for d in dims]
    layout = Layout(tuple(tuple(d) for d in dims), frozenset(partial))
    assume(layout.divides(shape, mesh))
    return layout


@st.composite
def general_conversions(draw: st.DrawFn) -> tuple[Mesh, tuple[int, ...], Layout, Layout]:
    mesh = draw(meshes())
    shape = draw(shapes(mesh))
    return mesh, shape, draw(general_layouts(mesh, shape)), draw(general_layouts(mesh, shape))


def _value(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1000, 1000, size=shape)


# --------------------------------------------------------------------------- (a) conversions are right


@settings(max_examples=300, deadline=None)
@given(conversions(), st.integers(0, 2**16))
def test_conversion_steps_turn_src_local_tensors_into_dst_local_tensors(case, seed: int) -> None:
    mesh, shape, src, dst = case
    simulate(src, dst, mesh, _value(shape, seed), seed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(general_conversions(), st.integers(0, 2**16))
def test_conversion_steps_are_right_for_any_axis_order_and_degree_one_axes(case, seed: int) -> None:
    mesh, shape, src, dst = case
    simulate(src, dst, mesh, _value(shape, seed), seed)


MESH_2x2x3 = Mesh(("dp", "tp", "x"), (2, 2, 3))


@pytest.mark.parametrize(
    ("src", "dst", "steps"),
    [
        # replicated -> sharded: a free local slice
        (Layout(((), ())), Layout((("tp",), ())), ["slice(tp)@0"]),
        # sharded -> replicated: all-gather
        (Layout(((), ("tp",))), Layout(((), ())), ["all_gather(tp)@1"]),
        # partial -> replicated: all-reduce (one step over both axes)
        (Layout(((), ()), frozenset({"tp", "x"})), Layout(((), ())), ["all_reduce(tp,x)"]),
        # partial -> sharded on the same axis: reduce-scatter
        (Layout(((), ()), frozenset({"tp"})), Layout(((), ("tp",))), ["reduce_scatter(tp)@1"]),
        # reduce-scatter onto an existing shard prefix
        (Layout((("dp",), ()), frozenset({"tp"})), Layout((("dp", "tp"), ())), ["reduce_scatter(tp)@0"]),
        # moving a shard between dims: gather then slice
        (Layout((("tp",), ())), Layout(((), ("tp",))), ["all_gather(tp)@0", "slice(tp)@1"]),
        # only the innermost axes that break the prefix are gathered
        (Layout((("dp", "tp"), ())), Layout((("dp", "x"), ())), ["all_gather(tp)@0", "slice(x)@0"]),
        (Layout((("tp", "dp"), ())), Layout((("dp", "tp"), ())), ["all_gather(dp)@0", "all_gather(tp)@0", "slice(dp)@0", "slice(tp)@0"]),
        # replicated -> partial: keep on the first rank (free)
        (Layout(((), ())), Layout(((), ()), frozenset({"x", "tp"})), ["zero(tp,x)"]),
        # partial over one axis swapped for partial over another
        (Layout(((), ()), frozenset({"tp"})), Layout(((), ()), frozenset({"x"})), ["all_reduce(tp)", "zero(x)"]),
    ],
    ids=str,
)
def test_conversion_steps_of_known_cases(src: Layout, dst: Layout, steps: list[str]) -> None:
    got = simulate(src, dst, MESH_2x2x3, _value((12, 12), 1))
    assert [str(s) for s in got] == steps


# --------------------------------------------------------------------------- (b) payload conventions


MESH_2x4 = Mesh(("dp", "tp"), (2, 4))


@pytest.mark.parametrize(
    ("step", "payload", "after"),
    [
        (Step("all_reduce", ("tp",)), 1000, 1000),  # the tensor
        (Step("all_reduce", ("dp", "tp")), 1000, 1000),
        (Step("all_gather", ("tp",), 0), 4000, 4000),  # the gathered output
        (Step("all_gather", ("dp",), 1), 2000, 2000),
        (Step("reduce_scatter", ("tp",), 0), 1000, 250),  # the full input
        (Step("reduce_scatter", ("dp",), 0), 1000, 500),
        (Step("slice", ("tp",), 0), 0, 250),  # free
        (Step("zero", ("dp", "tp")), 0, 1000),  # free
    ],
    ids=str,
)
def test_step_bytes_payload_conventions(step: Step, payload: int, after: int) -> None:
    assert step_bytes(step, 1000, MESH_2x4) == (payload, after)


def test_collective_flag_marks_only_communicating_steps() -> None:
    assert Step("all_reduce", ("tp",)).is_collective
    assert Step("all_gather", ("tp",), 0).is_collective
    assert Step("reduce_scatter", ("tp",), 0).is_collective
    assert not Step("slice", ("tp",), 0).is_collective
    assert not Step("zero", ("tp",)).is_collective


# --------------------------------------------------------------------------- (c) encode / parse


@pytest.mark.parametrize(
    ("layout", "text"),
    [
        (Layout(()), "0:|"),
        (Layout(((),)), "1:|"),
        (Layout(((), ())), "2:;|"),
        (Layout((), frozenset({"tp"})), "0:|tp"),
        (Layout(((),), frozenset({"tp", "dp"})), "1:|dp,tp"),
        (Layout((("dp", "tp"), (), ("x",))), "3:dp*tp;;x|"),
        (Layout((("tp", "dp"),)), "1:tp*dp|"),
    ],
    ids=str,
)
def test_layout_encodes_to_known_text_and_parses_back(layout: Layout, text: str) -> None:
    assert layout.encode() == text
    assert parse_layout(text) == layout


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(general_conversions())
def test_layout_and_spec_encode_parse_round_trip(case) -> None:
    mesh, _, layout, other = case
    assert parse_layout(layout.encode()) == layout
    grad = frozenset(layout.replicated_axes(mesh)) & frozenset(other.partial)
    spec = Spec(layout, grad)
    assert parse_spec(spec.encode()) == spec


def test_every_enumerated_layout_round_trips() -> None:
    mesh = MESH_2x2x3
    count = 0
    for shape in [(), (12,), (1,), (12, 12), (4, 6, 12)]:
        for layout in enumerate_layouts(shape, mesh):
            for partial in [frozenset(), layout.replicated_axes(mesh)]:
                lay = layout.with_partial(partial)
                assert parse_layout(lay.encode()) == lay
                assert parse_spec(Spec(lay).encode()) == Spec(lay)
                count += 1
    assert count > 50


def test_parse_rejects_a_dim_count_that_disagrees_with_the_rank() -> None:
    with pytest.raises(ValueError, match=r"2 dims for rank 3"):
        parse_layout("3:tp;dp|")


def test_layout_rejects_an_axis_used_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        Layout((("tp",), ("tp",)))
    with pytest.raises(ValueError, match="twice"):
        Layout((("tp",),), frozenset({"tp"}))


def test_spec_rejects_a_gradient_partial_over_a_sharded_or_partial_axis() -> None:
    with pytest.raises(ValueError, match=r"\['tp'\]"):
        Spec(Layout((("tp",),)), frozenset({"tp"}))
    with pytest.raises(ValueError, match=r"\['dp'\]"):
        Spec(Layout(((),), frozenset({"dp"})), frozenset({"dp"}))


def test_local_shape_divides_each_dim_by_its_group_size() -> None:
    lay = Layout((("dp", "tp"), (), ("x",)))
    assert lay.local_shape((8, 5, 6), MESH_2x2x3) == (2, 5, 2)
    assert lay.shard_factor(MESH_2x2x3) == 12
    with pytest.raises(ValueError, match=r"size 6 cannot be split 4 ways"):
        lay.local_shape((6, 5, 6), MESH_2x2x3)


# --------------------------------------------------------------------------- (d) identities, Megatron


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(general_conversions())
def test_conversion_from_a_layout_to_itself_is_empty(case) -> None:
    mesh, _, layout, _ = case
    assert conversion_steps(layout, layout, mesh) == ()
    assert spec_conversion(Spec(layout), Spec(layout), mesh).empty


def test_conversion_between_different_ranks_is_rejected() -> None:
    with pytest.raises(ValueError, match="different ranks"):
        conversion_steps(Layout(((),)), Layout(((), ())), MESH_2x4)


MEGATRON = Mesh(("dp", "tp"), (2, 4))
R2 = Layout(((), ()))


def test_megatron_f_is_identity_forward_and_all_reduce_backward() -> None:
    conv = spec_conversion(Spec(R2), Spec(R2, frozenset({"tp"})), MEGATRON)
    assert conv.forward == ()
    assert conv.backward == (Step("all_reduce", ("tp",)),)


def test_megatron_g_is_all_reduce_forward_and_identity_backward() -> None:
    conv = spec_conversion(Spec(R2.with_partial(frozenset({"tp"}))), Spec(R2), MEGATRON)
    assert conv.forward == (Step("all_reduce", ("tp",)),)
    assert conv.backward == ()


def test_sequence_parallel_gather_has_reduce_scatter_backward() -> None:
    # [tp,-] -> [-,-] with the gradient partial over tp: all-gather forward, reduce-scatter back.
    conv = spec_conversion(Spec(Layout((("tp",), ()))), Spec(R2, frozenset({"tp"})), MEGATRON)
    assert conv.forward == (Step("all_gather", ("tp",), 0),)
    assert conv.backward == (Step("reduce_scatter", ("tp",), 0),)


def test_data_parallel_gradient_all_reduce_over_dp_and_tp_is_one_step() -> None:
    conv = spec_conversion(Spec(R2), Spec(R2, frozenset({"dp", "tp"})), MEGATRON)
    assert conv.forward == ()
    assert conv.backward == (Step("all_reduce", ("dp", "tp")),)
