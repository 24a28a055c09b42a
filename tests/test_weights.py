"""runtime.weights: each rank reads only its boxes of the weights, from Hugging Face safetensors
(one file, or shards with an index) and from this project's checkpoints, by the model's own names.

On 4 gloo ranks (spawned once): Hugging Face Llama and GPT-2 (tied head) written by
``save_pretrained``, built again on the meta device, compiled under a 1-D and a ZeRO-3 plan with
``weights=`` the folder, compute the loss ``from_pretrained`` computes on one device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.layout import Layout
from planner.mesh import Mesh
from planner.runtime.collectives import relayout
from planner.runtime.groups import MeshGroups
from planner.runtime.weights import local_box, read_box, zero_box
from tests.harness import run_world

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.parametrize("dims", [(("a",), ()), ((), ("b", "a")), (("a", "b"), ()), (("b",), ("a",)), (("c", "a"), ("b",))])
def test_a_ranks_box_is_the_slice_sharding_gives_it(dims: tuple[tuple[str, ...], ...]) -> None:
    """On every rank of a 2 x 2 x 2 mesh, the full tensor's box equals what runtime.collectives cuts
    for the layout (the chunks of a dim over several axes in the layout's order)."""
    mesh = Mesh(("a", "b", "c"), (2, 2, 2))
    full = torch.arange(8 * 8 * 1.0).reshape(8, 8)
    layout = Layout(dims)
    for rank in range(mesh.size):
        mg = MeshGroups(mesh, rank, mesh.coords(rank))
        assert torch.equal(read_box(full, local_box(layout, (8, 8), mg)), relayout(full, Layout.replicated(2), layout, mg)), (rank, dims)


def test_a_zero_slice_is_the_chunk_of_the_box_the_optimizer_holds() -> None:
    mesh = Mesh(("dp", "tp"), (2, 2))
    full = torch.arange(8 * 6 * 1.0).reshape(8, 6)
    layout = Layout(((), ("tp",)))
    for rank in range(mesh.size):
        mg = MeshGroups(mesh, rank, mesh.coords(rank))
        box = local_box(layout, (8, 6), mg)
        want = read_box(full, box).chunk(2, 0)[mg.coords["dp"]]
        assert torch.equal(read_box(full, zero_box(box, ("dp",), mg)), want)


CASES = [  # (preset, tp family, dp, ZeRO stage, files)
    ("hf-llama", "1d", 1, 0, "one file"),
    ("hf-llama", "none", 4, 3, "sharded"),
    ("hf-gpt2", "1d", 1, 0, "sharded"),
    ("hf-gpt2", "none", 4, 3, "one file"),
]


def _losses(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import transformers

    from planner.models import build_model, example_inputs
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    out = []
    for name, text, folder in cases:
        args, kwargs = example_inputs(name, batch=4, seed=1)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
        want = reference(*args, **kwargs).loss.item()
        plan = Plan.model_validate_json(text)
        mesh = None
        if len(out) == 0:  # the first case runs on a DeviceMesh of the user's (the others on the runtime's own)
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", tuple(plan.mesh.values()), mesh_dim_names=tuple(plan.mesh))
        pm = compile_plan(plan, build_model(name, device="meta", seed=None), args, kwargs, weights=folder, device_mesh=mesh)
        local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
        row: dict[str, Any] = {"users_mesh": mesh is None or pm.device_mesh is mesh,"loss": pm(*local_args, **local_kwargs).item(), "want": want,
                               "local_bytes": sum(p.numel() * p.element_size() for p in pm.parameters())}
        # the model's own names: shards under them, and the full state back into a fresh model
        own = reference.state_dict()
        shards = pm.state_dict()
        row["state_dict_names"] = set(shards) == set(own)
        row["named_parameters"] = {n for n, _ in pm.named_parameters(remove_duplicate=False)} == {n for n, _ in reference.named_parameters(remove_duplicate=False)}
        pm.load_state_dict(shards)  # its own shards go back in, strict
        full = pm.full_state_dict()
        fresh = build_model(name, seed=5)
        fresh.load_state_dict(full, strict=True)
        row["full_equals_file"] = all(torch.equal(full[n], t) for n, t in own.items())
        again = f"{folder}-again-{len(out)}"  # beside the test's folder: every rank reads what rank 0 wrote
        if rank == 0:
            fresh.save_pretrained(again)
        dist.barrier()
        row["round_trip_loss"] = transformers.AutoModelForCausalLM.from_pretrained(again).train()(*args, **kwargs).loss.item()
        # DeviceMesh and DTensor views of the shards
        row["mesh_names"] = tuple(pm.device_mesh.mesh_dim_names)
        row["plan_axes"] = tuple(pm.plan.mesh)
        dtensors = {n: pm.to_dtensor(n) for n, _ in pm.named_parameters() if pm.placements(n) is not None}
        row["dtensor_share"] = len(dtensors) / len(list(pm.named_parameters()))
        row["dtensors_exact"] = all(torch.equal(d.full_tensor(), own[n]) for n, d in dtensors.items())
        out.append(row)
    return out


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[tuple[str, str, int, int, str], dict[str, Any], list[dict[str, Any]]]]:
    from planner.config import SearchConfig
    from planner.models import build_model, example_inputs
    from planner.search import search
    from planner.trace import trace

    cases, plans, files = [], [], {}
    for name, tp, dp, zero, how in CASES:
        key = (name, how)
        if key not in files:
            folder = tmp_path_factory.mktemp(f"{name}-{how.replace(' ', '-')}")
            model = build_model(name, seed=0)
            model.save_pretrained(folder, max_shard_size="20KB" if how == "sharded" else "1GB")
            index = folder / "model.safetensors.index.json"
            assert index.exists() == (how == "sharded")
            files[key] = (str(folder), {"params": sum(p.numel() * p.element_size() for p in model.parameters()),
                                        "files": len(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else 1})
        meta = build_model(name, device="meta", seed=None)
        graph = trace(meta, *example_inputs(name, batch=4, seed=1))
        result = search(graph, SearchConfig(devices=4, dp=dp, tp=(tp,), zero=(zero,), front=False, objective="memory"), model_name=name)
        assert result.best is not None and result.best.zero_stage == zero
        cases.append((name, tp, dp, zero, how))
        plans.append((name, result.best.model_dump_json(), files[key][0]))
    per_rank = run_world(4, _losses, plans, timeout=600)
    return [(case, files[(case[0], case[4])][1], [r[i] for r in per_rank]) for i, case in enumerate(cases)]


def test_sharded_files_are_read_through_their_index(hf_runs) -> None:  # type: ignore[no-untyped-def]
    for (name, *_, how), info, _ in hf_runs:
        assert (info["files"] > 1) == (how == "sharded"), (name, how, info)


def test_the_loss_from_safetensors_equals_from_pretrained_on_one_device(hf_runs) -> None:  # type: ignore[no-untyped-def]
    """float32: the sharded sums round differently (1-D's row-parallel partial sums), so 1e-6."""
    for case, _, ranks in hf_runs:
        for rank, r in enumerate(ranks):
            assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), (case, rank, r)


def test_the_model_s_own_names_everywhere_and_the_full_state_loads_back(hf_runs) -> None:  # type: ignore[no-untyped-def]
    """pm.state_dict() and named_parameters() use the model's names (GPT-2's tied head under both);
    full_state_dict() loads strict into a fresh model, whose save_pretrained -> from_pretrained
    gives the same loss."""
    for case, _, ranks in hf_runs:
        for r in ranks:
            assert r["state_dict_names"] and r["named_parameters"], case
            assert r["full_equals_file"], case
            assert r["round_trip_loss"] == r["want"], (case, r["round_trip_loss"], r["want"])


def test_the_device_mesh_has_the_plans_axes_and_shards_read_as_dtensors(hf_runs) -> None:  # type: ignore[no-untyped-def]
    for case, _, ranks in hf_runs:
        for r in ranks:
            assert r["mesh_names"] == r["plan_axes"] and r["users_mesh"], case
            assert r["dtensor_share"] >= 0.9 and r["dtensors_exact"], (case, r["dtensor_share"])


def test_a_device_mesh_of_other_axes_is_refused_with_the_plans() -> None:
    from planner.runtime.groups import check_device_mesh

    class _Mesh:  # what check_device_mesh reads of a DeviceMesh
        mesh_dim_names = ("tp", "dp")
        mesh = torch.arange(4).reshape(2, 2)

    with pytest.raises(ValueError, match=r"axes \('tp', 'dp'\) of sizes \(2, 2\); the plan's mesh .* init_device_mesh"):
        check_device_mesh(_Mesh(), Mesh(("dp", "tp"), (2, 2)))


def test_each_rank_holds_its_shards_not_the_model(hf_runs) -> None:  # type: ignore[no-untyped-def]
    for case, info, ranks in hf_runs:
        for r in ranks:
            assert r["local_bytes"] < 0.6 * info["params"], (case, r["local_bytes"], info["params"])


def test_a_box_of_a_safetensors_file_reads_that_box(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from planner.runtime.weights import SafetensorsSource

    full = torch.arange(12.0).reshape(3, 4)
    save_file({"a.weight": full}, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    assert source.names() == {"a.weight"} and source.shape("a.weight") == (3, 4)
    assert torch.equal(source.read({"a.weight": ((1, 2), (2, 2))})["a.weight"], full[1:3, 2:4])


class _OneRank:
    """What load_weights reads of a ParallelModule, for one rank of one device."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        from planner.layout import Spec

        self.params = params
        self.param_names = {k: (k,) for k in params}
        self.param_specs = {k: Spec(Layout.replicated(p.dim())) for k, p in params.items()}
        self.mesh_groups = MeshGroups(Mesh(("dp",), (1,)), 0, {"dp": 0})

    def local_parameters(self) -> dict[str, torch.nn.Parameter]:
        return self.params

    def named_original_buffers(self) -> dict[str, torch.Tensor]:
        return {}


def test_a_parameter_the_file_lacks_is_named_and_strict_false_keeps_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from planner.runtime.weights import load_weights

    save_file({"a.weight": torch.ones(2, 2), "extra": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
    pm = _OneRank({"a.weight": torch.nn.Parameter(torch.zeros(2, 2)), "b.weight": torch.nn.Parameter(torch.full((3,), 7.0))})
    with pytest.raises(ValueError, match=r"has no b\.weight \(1 of the model's parameters\); pass strict=False"):
        load_weights(pm, tmp_path / "w.safetensors")
    report = load_weights(pm, tmp_path / "w.safetensors", strict=False)
    assert report.loaded == ("a.weight",) and report.unexpected == ("extra",)
    assert torch.equal(pm.params["a.weight"], torch.ones(2, 2)) and torch.equal(pm.params["b.weight"], torch.full((3,), 7.0))


def test_weights_of_another_shape_are_refused_with_both_shapes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from planner.runtime.weights import load_weights

    save_file({"a.weight": torch.ones(2, 3)}, str(tmp_path / "w.safetensors"))
    pm = _OneRank({"a.weight": torch.nn.Parameter(torch.zeros(2, 2))})
    with pytest.raises(ValueError, match=r"a.weight is \[2, 3\] in .*, \[2, 2\] in the model"):
        load_weights(pm, tmp_path / "w.safetensors")
