"""Specification of :class:`planner.mesh.Mesh`: named axes laid out row-major over global ranks,
each with a role (data or tensor) that plans store."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from planner.hardware import A100_80G
from planner.mesh import AxisRole, Mesh, roles_from_names
from planner.models import build_model, example_inputs
from planner.plan import Plan
from planner.problem import build_problem
from planner.search import make_plan
from planner.solve import solve
from planner.trace import trace

DATA, TENSOR = AxisRole.DATA, AxisRole.TENSOR

# --------------------------------------------------------------------------- hypothesis inputs


@st.composite
def meshes(draw: st.DrawFn, max_size: int = 24) -> Mesh:
    names = draw(st.permutations(["dp", "tp", "x", "dp2"]))
    n = draw(st.integers(1, 4))
    degrees = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n).filter(lambda ds: math.prod(ds) <= max_size))
    return Mesh(tuple(names[:n]), tuple(degrees))


@st.composite
def mesh_and_axes(draw: st.DrawFn) -> tuple[Mesh, tuple[str, ...]]:
    mesh = draw(meshes())
    axes = draw(st.lists(st.sampled_from(mesh.axes), unique=True))
    return mesh, tuple(axes)


def _linear(mesh: Mesh, rank: int, axes: tuple[str, ...]) -> int:
    """Row-major linear index of ``rank``'s coordinates over ``axes`` (in the order given)."""
    c = mesh.coords(rank)
    idx = 0
    for a in axes:
        idx = idx * mesh.degree(a) + c[a]
    return idx


# --------------------------------------------------------------------------- coordinates


def test_coords_of_dp4_tp2_are_rank_div_2_and_rank_mod_2() -> None:
    mesh = Mesh(("dp", "tp"), (4, 2))
    assert [mesh.coords(r) for r in range(8)] == [{"dp": r // 2, "tp": r % 2} for r in range(8)]


def test_coords_of_three_axes_are_row_major_with_last_axis_innermost() -> None:
    mesh = Mesh(("a", "b", "c"), (2, 3, 2))
    assert mesh.coords(0) == {"a": 0, "b": 0, "c": 0}
    assert mesh.coords(1) == {"a": 0, "b": 0, "c": 1}
    assert mesh.coords(2) == {"a": 0, "b": 1, "c": 0}
    assert mesh.coords(6) == {"a": 1, "b": 0, "c": 0}
    assert mesh.coords(11) == {"a": 1, "b": 2, "c": 1}


def test_strides_are_products_of_inner_degrees() -> None:
    mesh = Mesh(("a", "b", "c"), (2, 3, 5))
    assert (mesh.stride("a"), mesh.stride("b"), mesh.stride("c")) == (15, 5, 1)


@given(meshes())
def test_coords_are_a_bijection_from_ranks_onto_the_coordinate_grid(mesh: Mesh) -> None:
    seen = {tuple(mesh.coords(r)[a] for a in mesh.axes) for r in range(mesh.size)}
    assert seen == set(itertools.product(*(range(d) for d in mesh.degrees)))
    for r in range(mesh.size):
        assert sum(mesh.coords(r)[a] * mesh.stride(a) for a in mesh.axes) == r


# --------------------------------------------------------------------------- groups


def test_groups_of_dp2_tp2() -> None:
    mesh = Mesh(("dp", "tp"), (2, 2))
    assert mesh.groups(("tp",)) == [[0, 1], [2, 3]]
    assert mesh.groups(("dp",)) == [[0, 2], [1, 3]]
    assert mesh.groups(("dp", "tp")) == [[0, 1, 2, 3]]
    assert mesh.groups(()) == [[0], [1], [2], [3]]


def test_groups_of_dp2_x3_tp2_over_outer_and_inner_axis() -> None:
    mesh = Mesh(("dp", "x", "tp"), (2, 3, 2))
    # dp and tp vary, x fixed: the group's local order is (dp, tp) row-major.
    assert mesh.groups(("dp", "tp")) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert mesh.groups(("x",)) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]


def test_groups_ignore_the_order_the_axes_are_given_in() -> None:
    mesh = Mesh(("dp", "x", "tp"), (2, 3, 2))
    assert mesh.groups(("tp", "dp")) == mesh.groups(("dp", "tp"))
    assert mesh.groups(("tp", "x", "dp")) == [list(range(12))]


@given(mesh_and_axes())
def test_groups_partition_the_ranks(case: tuple[Mesh, tuple[str, ...]]) -> None:
    mesh, axes = case
    groups = mesh.groups(axes)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.size))
    assert len(groups) == mesh.size // mesh.group_size(axes)


@given(mesh_and_axes())
def test_each_group_has_group_size_ranks_differing_only_on_its_axes(case: tuple[Mesh, tuple[str, ...]]) -> None:
    mesh, axes = case
    others = [a for a in mesh.axes if a not in axes]
    for group in mesh.groups(axes):
        assert len(group) == mesh.group_size(axes)
        fixed = {tuple(mesh.coords(r)[a] for a in others) for r in group}
        assert len(fixed) == 1


@given(mesh_and_axes())
def test_group_order_is_row_major_over_the_axes_in_mesh_order(case: tuple[Mesh, tuple[str, ...]]) -> None:
    mesh, axes = case
    ordered = mesh.sort_axes(axes)
    for group in mesh.groups(axes):
        assert [_linear(mesh, r, ordered) for r in group] == list(range(len(group)))
        assert group == sorted(group)  # row-major over mesh-ordered axes means increasing rank


# --------------------------------------------------------------------------- sizes


def test_size_and_group_size_multiply_degrees() -> None:
    mesh = Mesh(("dp", "x", "tp"), (2, 3, 4))
    assert mesh.size == 24
    assert mesh.group_size(()) == 1
    assert mesh.group_size(("tp",)) == 4
    assert mesh.group_size(("dp", "tp")) == 8
    assert mesh.group_size(frozenset({"x", "tp"})) == 12
    assert mesh.group_size(("dp", "x", "tp")) == 24


def test_degree_one_axes_add_no_ranks() -> None:
    mesh = Mesh(("dp", "tp"), (1, 2))
    assert mesh.size == 2
    assert mesh.groups(("dp",)) == [[0], [1]]
    assert mesh.groups(("tp",)) == [[0, 1]]


# --------------------------------------------------------------------------- helpers


def test_from_dict_and_as_dict_round_trip_in_axis_order() -> None:
    mesh = Mesh.from_dict({"dp": 4, "tp": 2})
    assert mesh == Mesh(("dp", "tp"), (4, 2))
    assert list(mesh.as_dict().items()) == [("dp", 4), ("tp", 2)]




def test_sort_axes_returns_mesh_order() -> None:
    mesh = Mesh(("dp", "x", "tp"), (2, 3, 2))
    assert mesh.sort_axes({"tp", "dp"}) == ("dp", "tp")
    assert mesh.sort_axes(("tp", "x")) == ("x", "tp")
    assert mesh.sort_axes(frozenset()) == ()


def test_str_lists_axes_with_degrees() -> None:
    assert str(Mesh(("dp", "tp"), (4, 2))) == "dp=4 x tp=2"


# --------------------------------------------------------------------------- roles


def test_roles_left_out_follow_the_naming_convention_dp_star_is_data_the_rest_tensor() -> None:
    mesh = Mesh(("dp", "x", "dp_outer", "tp"), (2, 1, 2, 2))
    assert mesh.roles == roles_from_names(mesh.axes) == (DATA, TENSOR, DATA, TENSOR)
    assert mesh.dp_axes == ("dp", "dp_outer")
    assert mesh.tp_axes == ("x", "tp")
    assert mesh.is_dp("dp_outer") and not mesh.is_dp("tp")
    assert Mesh.from_dict({"dp": 4, "tp": 2}).roles == (DATA, TENSOR)


def test_roles_given_explicitly_are_honoured_whatever_the_names() -> None:
    mesh = Mesh(("x", "dp2"), (2, 4), roles=(DATA, TENSOR))
    assert mesh.dp_axes == ("x",) and mesh.tp_axes == ("dp2",)
    assert mesh.role("x") is DATA and mesh.role("dp2") is TENSOR
    assert mesh.is_dp("x") and not mesh.is_dp("dp2")


def test_roles_given_as_their_plan_strings_become_axis_roles() -> None:
    mesh = Mesh(("x", "y"), (2, 2), roles=("data", "tensor"))  # type: ignore[arg-type]
    assert mesh.roles == (DATA, TENSOR) and all(type(r) is AxisRole for r in mesh.roles)
    assert mesh == Mesh(("x", "y"), (2, 2), roles=(DATA, TENSOR))


def test_from_dict_takes_roles_by_axis_in_the_meshs_axis_order() -> None:
    mesh = Mesh.from_dict({"x": 2, "tp": 4}, {"tp": TENSOR, "x": DATA})
    assert mesh == Mesh(("x", "tp"), (2, 4), roles=(DATA, TENSOR))
    assert mesh.roles_dict() == {"x": DATA, "tp": TENSOR}


def test_meshes_differing_only_in_roles_are_different_values_and_keys() -> None:
    by_name = Mesh(("dp", "tp"), (2, 2))
    swapped = Mesh(("dp", "tp"), (2, 2), roles=(TENSOR, DATA))
    assert by_name == Mesh(("dp", "tp"), (2, 2), roles=(DATA, TENSOR))
    assert hash(by_name) == hash(Mesh(("dp", "tp"), (2, 2), roles=(DATA, TENSOR)))
    assert by_name != swapped and len({by_name: 1, swapped: 2}) == 2
    assert swapped.sort_axes({"tp", "dp"}) == ("dp", "tp")  # lru_cached per mesh: roles do not change the order


def test_str_marks_only_the_roles_the_names_do_not_give() -> None:
    assert str(Mesh(("dp", "tp"), (4, 2), roles=(DATA, TENSOR))) == "dp=4 x tp=2"
    assert str(Mesh(("x", "dp2"), (4, 2), roles=(DATA, TENSOR))) == "x=4(data) x dp2=2(tensor)"


# --------------------------------------------------------------------------- errors


def test_wrong_number_of_roles_error_quotes_both_counts() -> None:
    with pytest.raises(ValueError, match=r"mesh axes \('dp', 'tp'\) are 2 but roles \('data',\) are 1: give one role per axis"):
        Mesh(("dp", "tp"), (4, 2), roles=(DATA,))
    with pytest.raises(ValueError, match=r"are 1 but roles \('data', 'tensor'\) are 2"):
        Mesh(("dp",), (4,), roles=(DATA, TENSOR))


def test_an_unknown_role_error_names_the_axis_and_the_roles() -> None:
    with pytest.raises(ValueError, match=r"mesh axis 'pp' has role 'pipeline'; roles are data, tensor"):
        Mesh(("dp", "pp"), (2, 2), roles=(DATA, "pipeline"))  # type: ignore[arg-type]


def test_from_dict_roles_for_other_axes_error_names_them() -> None:
    with pytest.raises(ValueError, match=r"mesh dp=4 x tp=2: roles are given for axes \['dp', 'pp'\]; none for \['tp'\]; \['pp'\] are not mesh axes"):
        Mesh.from_dict({"dp": 4, "tp": 2}, {"dp": DATA, "pp": TENSOR})


def test_role_of_an_unknown_axis_error_quotes_its_name() -> None:
    mesh = Mesh(("dp", "tp"), (2, 2))
    with pytest.raises(ValueError, match=r"no axis 'dp2'"):
        mesh.role("dp2")
    with pytest.raises(ValueError, match=r"no axis 'dp2'"):
        mesh.is_dp("dp2")  # not read off the name: an axis the mesh lacks has no role




def test_mismatched_lengths_error_quotes_both_tuples() -> None:
    with pytest.raises(ValueError, match=r"\('dp', 'tp'\).*\(4,\)"):
        Mesh(("dp", "tp"), (4,))


def test_degree_below_one_error_quotes_the_axis_and_degree() -> None:
    with pytest.raises(ValueError, match=r"'tp' has degree 0"):
        Mesh(("dp", "tp"), (2, 0))
    with pytest.raises(ValueError, match=r"'dp' has degree -3"):
        Mesh(("dp",), (-3,))


def test_duplicate_axis_names_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"unique.*\('tp', 'tp'\)"):
        Mesh(("tp", "tp"), (2, 2))


def test_unknown_axis_error_quotes_its_name() -> None:
    mesh = Mesh(("dp", "tp"), (2, 2))
    with pytest.raises(ValueError, match=r"no axis 'pp'"):
        mesh.degree("pp")
    with pytest.raises(ValueError, match=r"no axis 'pp'"):
        mesh.group_size(("tp", "pp"))


@settings(max_examples=30)
@given(meshes())
def test_groups_over_all_axes_is_one_group_of_all_ranks(mesh: Mesh) -> None:
    assert mesh.groups(mesh.axes) == [list(range(mesh.size))]
    assert mesh.groups(()) == [[r] for r in range(mesh.size)]


# --------------------------------------------------------------------------- roles in plans


def _plan_on(mesh: Mesh) -> Plan:
    """mlp-tiny's fastest ZeRO-1 plan on ``mesh`` (ZeRO shards optimizer state over the DATA axes)."""
    args, kwargs = example_inputs("mlp-tiny", batch=4)
    graph = trace(build_model("mlp-tiny"), args, kwargs)
    problem = build_problem(graph, mesh, A100_80G, zero_stage=1)
    return make_plan(graph, problem, solve(problem, memory_budget=2**30), model_name="mlp-tiny", memory_budget=2**30)


@pytest.fixture(scope="module")
def x_y_plan() -> Plan:
    return _plan_on(Mesh(("x", "y"), (2, 2), roles=(DATA, TENSOR)))


def test_a_plan_round_trip_keeps_the_mesh_roles(x_y_plan: Plan) -> None:
    assert x_y_plan.mesh == {"x": 2, "y": 2} and x_y_plan.mesh_roles == {"x": DATA, "y": TENSOR}
    assert '"mesh_roles":{"x":"data","y":"tensor"}' in x_y_plan.model_dump_json()
    again = Plan.model_validate_json(x_y_plan.model_dump_json())
    assert again == x_y_plan
    assert again.mesh_obj == Mesh(("x", "y"), (2, 2), roles=(DATA, TENSOR))


def test_a_plan_prices_by_roles_not_names(x_y_plan: Plan) -> None:
    """The same mesh named dp x tp: the same step time, peak memory and collectives (renamed)."""
    by_name = _plan_on(Mesh(("dp", "tp"), (2, 2)))
    assert (x_y_plan.step_time_s, x_y_plan.peak_memory_bytes) == (by_name.step_time_s, by_name.peak_memory_bytes)
    rename = {"x": "dp", "y": "tp"}
    assert {(k, tuple(rename[a] for a in axes), n, ph): c for (k, axes, n, ph), c in x_y_plan.priced_comms().items()} == by_name.priced_comms()
    assert any("dp" in axes for (_, axes, _, _) in by_name.priced_comms())  # the data axis does carry collectives (the gradient sync)


def test_a_plan_saved_before_plans_stored_roles_loads_with_the_naming_conventions(x_y_plan: Plan) -> None:
    data = json.loads(x_y_plan.model_dump_json())
    data["mesh"] = {"dp": 2, "y": 2}
    del data["mesh_roles"]
    old = Plan.model_validate(data)
    assert old.mesh_roles == {"dp": DATA, "y": TENSOR}
    assert old.mesh_obj == Mesh(("dp", "y"), (2, 2))


def test_a_plan_whose_roles_name_other_axes_is_refused(x_y_plan: Plan) -> None:
    data = json.loads(x_y_plan.model_dump_json())
    data["mesh_roles"] = {"y": "tensor", "x": "data"}
    with pytest.raises(ValidationError, match=r"mesh_roles names axes \['y', 'x'\]; the plan's mesh has axes \['x', 'y'\]"):
        Plan.model_validate(data)
    data["mesh_roles"] = {"x": "data", "y": "pipeline"}
    with pytest.raises(ValidationError, match=r"mesh_roles\.y"):
        Plan.model_validate(data)
