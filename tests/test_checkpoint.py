"""Checkpoints (torch.distributed.checkpoint): atomic writes, and state that moves between plans and world sizes.

Saved under dp=4 ZeRO-3 on 4 ranks after two AdamW steps; resumed under dp=2 x tp=2 ZeRO-1 on the
same 4 ranks and under dp=2 ZeRO-2 on 2 ranks: parameters and optimizer states equal the saved
ones bit for bit after the move, and the next step's loss equals the uninterrupted run's (1e-9).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import planner.runtime.checkpoint as ckpt
from planner.config import SearchConfig
from planner.models import build_model, example_inputs
from planner.search import search
from planner.trace import trace
from tests.harness import run_world
from tests.memory_probe import allocator_count, counting_every_thread, peak_count, storage_bytes
from tests.test_same_math import data_parallel, megatron_dp

MODEL = "gpt-tiny-nobias"
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def test_a_crash_mid_write_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    ckpt.write_state({"step": torch.tensor(1), "w": torch.arange(4.0)}, path)
    first = path.resolve()

    def broken_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp.FileSystemWriter, "write_data", broken_write)
    with pytest.raises(ckpt.CheckpointError, match="disk full"):
        ckpt.write_state({"step": torch.tensor(2), "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    kept = ckpt.read_state(path)
    assert path.resolve() == first
    assert int(kept["step"]) == 1 and torch.equal(kept["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", first.name]), "the partial folder is removed"


def test_a_new_save_replaces_the_old_folder(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.zeros(2)}, path)
    ckpt.write_state({"w": torch.ones(2)}, path)
    assert torch.equal(ckpt.read_state(path)["w"], torch.ones(2))
    assert len(list(tmp_path.iterdir())) == 2, "one link and one folder"


def test_a_plain_folder_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint link"):
        ckpt.write_state({"w": torch.zeros(2)}, tmp_path / "mine")


def test_loading_never_unpickles_dcps_metadata(tmp_path: Path) -> None:
    """A stranger's ``.metadata`` pickle that would run code is never opened: the manifest (JSON)
    is the only metadata a load reads."""
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.arange(4.0), "progress": {"step": 7}}, path)
    ran = tmp_path / "ran"
    (path.resolve() / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(ran))))
    state = ckpt.read_state(path)
    assert torch.equal(state["w"], torch.arange(4.0)) and state["progress"] == {"step": 7}
    assert not ran.exists()


class _RunsCode:
    def __init__(self, file: str) -> None:
        self.file = file

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.file).touch, ())


def test_a_checkpoint_without_manifest_needs_trust(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.arange(4.0)}, path)
    (path.resolve() / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="trust_pickle=True"):
        ckpt.read_state(path)
    assert torch.equal(ckpt.read_state(path, trust_pickle=True)["w"], torch.arange(4.0))


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated or partial"),
    ("missing", "is missing"),
    ("traversal", "not a plain .distcp name"),
    ("outside", "outside the tensor"),
    ("version", "newer than this runtime"),
    ("garbage", "not a valid manifest"),
    ("dtype", "unknown dtype"),
])
def test_a_damaged_checkpoint_is_one_clear_error(tmp_path: Path, damage: str, message: str) -> None:
    """Truncated, partial or tampered files raise CheckpointError (an Exception, unlike DCP's
    CheckpointException) naming what is wrong; nothing of torch's leaks."""
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.arange(64.0), "v": torch.ones(3, 2)}, path)
    folder = path.resolve()
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    data = folder / next(iter(manifest["files"]))
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "missing":
        data.unlink()
    elif damage == "traversal":
        manifest["files"] = {"../../etc/passwd": 1}
    elif damage == "outside":
        manifest["tensors"]["v"]["chunks"][0]["sizes"] = [4, 2]
    elif damage == "version":
        manifest["version"] = 99
    elif damage == "garbage":
        manifest = {"tensors": 1}
    elif damage == "dtype":
        manifest["tensors"]["v"]["dtype"] = "Tensor"
    if damage not in ("truncate", "missing"):
        (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.read_state(path)


def test_a_corrupt_payload_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.arange(64.0)}, path)
    folder = path.resolve()
    data = folder / next(iter(json.loads((folder / ckpt.MANIFEST).read_text())["files"]))
    raw = bytearray(data.read_bytes())
    raw[:200] = bytes(200)  # same size, wrong bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="could not be read"):
        ckpt.read_state(path)


def test_the_next_save_removes_what_a_crash_left(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckpt.write_state({"w": torch.zeros(2)}, path)
    crashed = tmp_path / ".ckpt.0123456789ab"  # a save killed before its link swap
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half")
    os.symlink(crashed.name, tmp_path / ".ckpt.0123456789ab.link")
    other = tmp_path / ".other.0123456789ab"  # another checkpoint's folder is not touched
    other.mkdir()
    ckpt.write_state({"w": torch.ones(2)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", path.resolve().name, other.name])
    assert torch.equal(ckpt.read_state(path)["w"], torch.ones(2))


def test_what_json_cannot_hold_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"'loader'.*JSON"):
        ckpt.write_state({"w": torch.zeros(2), "loader": object()}, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def _mlp_module(layers: int, hidden: int = 32) -> Any:
    from planner.models.mlp import MLP, MLPConfig, mlp_example_inputs
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    config = MLPConfig(in_features=16, hidden=hidden, out_features=8, n_layers=layers)
    torch.manual_seed(0)
    model = MLP(config).double()
    args, kwargs = mlp_example_inputs(config, 4, dtype=torch.float64, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
    result = search(trace(model, args, kwargs), SearchConfig(devices=1, front=False), model_name="mlp")
    assert result.best is not None
    pm = compile_plan(Plan.model_validate_json(result.best.model_dump_json()), model, args, kwargs)
    return pm, pm.make_optimizer(torch.optim.AdamW, lr=1e-3)


def _refusals(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a 2-layer MLP of width 32, load it into 1 or 3 layers or width 48: each error's text."""
    pm, opt = _mlp_module(2)
    ckpt.save_checkpoint(pm, opt, path, step=1)
    out: dict[str, Any] = {}
    for other in ((1, 32), (3, 32), (2, 48)):
        pm_b, opt_b = _mlp_module(*other)
        try:
            ckpt.load_checkpoint(pm_b, opt_b, path)
            out[str(other)] = "loaded"
        except ckpt.CheckpointError as exc:
            out[str(other)] = str(exc)
        if other == (1, 32):
            out["non-strict step"] = ckpt.load_checkpoint(pm_b, opt_b, path, strict=False)["step"]
    return out


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_world(1, _refusals, str(tmp_path_factory.mktemp("ckpt") / "mlp"), timeout=300)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("other, message", [
    ((1, 32), r"holds 2 parameter\(s\) the model does not have, first 'layers.1.fc.bias'.*strict=False"),
    ((3, 32), "has no parameter 'layers.2.fc.weight'"),
    ((2, 48), r"holds layers.0.fc.\w+ as \[32(, 16)?\], the model as \[48(, 16)?\]"),
])
def test_a_checkpoint_of_another_model_is_refused(refusals: dict[str, Any], other: tuple[int, int], message: str) -> None:
    """Saved from a 2-layer MLP of width 32; loaded into 1 or 3 layers, or width 48: refused,
    naming the first difference (and strict=False loads what the 1-layer model has)."""
    assert re.search(message, refusals[str(other)]), refusals[str(other)]
    assert refusals["non-strict step"] == 1


def _plan(devices: int, dp: int, zero: int, family: str, allow: Any, dtype: torch.dtype = torch.float64) -> str:
    model = build_model(MODEL, dtype=dtype)
    args, kwargs = example_inputs(MODEL, batch=4, dtype=dtype)
    master = "float32" if dtype == torch.bfloat16 else None
    config = SearchConfig(devices=devices, dp=dp, zero=(zero,), tp=(family,), master_dtype=master, front=False)
    result = search(trace(model, args, kwargs), config, model_name=MODEL, allow=allow)
    assert result.best is not None and result.best.zero_stage == zero
    return result.best.model_dump_json()


def _batches() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [example_inputs(MODEL, batch=4, dtype=torch.float64, seed=200 + i) for i in range(3)]


def _step(pm: Any, opt: Any, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> float:
    args, kwargs = pm.shard_batch(*batch[0], **batch[1])
    loss = pm(*args, **kwargs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def save_then_move(rank: int, world: int, plan_a: str, plan_b: str, path: str, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    batches = _batches()
    pm_a = compile_plan(Plan.model_validate_json(plan_a), build_model(MODEL, dtype=dtype, seed=0), *batches[0])
    opt_a = pm_a.make_optimizer(torch.optim.AdamW, **ADAMW)
    for batch in batches[:2]:
        _step(pm_a, opt_a, batch)
    with counting_every_thread():
        before = allocator_count()
        save_peak = peak_count(lambda: ckpt.save_checkpoint(pm_a, opt_a, path, step=2, extra={"loader": {"epoch": 0, "batch": 8}})) - before
    params, states = pm_a.full_state_dict(), ckpt.full_optimizer_state(pm_a, opt_a)
    held_a = _held(pm_a, opt_a)
    stored = ckpt.Stored(path).metadata.state_dict_metadata
    chunks = {}  # each parameter: (its stored chunks' shapes, this rank's shard's shape, the full shape)
    for attr, p in pm_a.local_parameters().items():
        md = stored[f"model/{pm_a.param_names[attr][0]}"]
        chunks[attr] = ([tuple(c.sizes) for c in md.chunks], tuple(p.shape), tuple(md.size))
    uninterrupted = _step(pm_a, opt_a, batches[2])
    pm_b = compile_plan(Plan.model_validate_json(plan_b), build_model(MODEL, dtype=dtype, seed=1), *batches[0])
    opt_b = pm_b.make_optimizer(torch.optim.AdamW, **ADAMW)
    progress: dict[str, Any] = {}
    with counting_every_thread():
        before = allocator_count()
        load_peak = peak_count(lambda: progress.update(ckpt.load_checkpoint(pm_b, opt_b, path))) - before
    moved_params, moved_states = pm_b.full_state_dict(), ckpt.full_optimizer_state(pm_b, opt_b)
    resumed = _step(pm_b, opt_b, batches[2])
    return {
        "params_bitwise": _same(params, moved_params),
        "states_bitwise": _same(states, moved_states),
        "has_states": all(len(s) >= 3 for s in states.values()),
        "has_masters": all("master" in s and s["master"].dtype == torch.float32 for s in states.values()),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "progress": progress,
        "chunks": chunks,
        "save_peak": save_peak, "held_a": held_a, "load_peak": load_peak, "held_b": _held(pm_b, opt_b),
    }


def _held(pm: Any, opt: Any) -> dict[str, int]:
    """This rank's bytes of parameters and of optimizer states (tensors), and its largest one."""
    params = list(pm.local_parameters().values())
    states = [v for st in ckpt._inner(opt).state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(params), "states": storage_bytes(states),
            "largest": max(t.numel() * t.element_size() for t in params + states)}


def load_elsewhere(rank: int, world: int, plan_c: str, path: str) -> dict[str, Any]:
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    batches = _batches()
    pm = compile_plan(Plan.model_validate_json(plan_c), build_model(MODEL, dtype=torch.float64, seed=2), *batches[0])
    opt = pm.make_optimizer(torch.optim.AdamW, **ADAMW)
    ckpt.load_checkpoint(pm, opt, path)
    saved = ckpt.read_state(path)
    params = {f"model/{k}": v for k, v in pm.full_state_dict().items()}
    states = {f"optimizer/{n}/{k}": v for n, entry in ckpt.full_optimizer_state(pm, opt).items() for k, v in entry.items()}
    return {
        "params_bitwise": _same({k: v for k, v in saved.items() if k.startswith("model/")}, params),
        "states_bitwise": _same({k: v for k, v in saved.items() if k.startswith("optimizer/")}, states),
        "resumed": _step(pm, opt, batches[2]),
    }


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("ckpt") / "gpt")
    plan_a = _plan(4, 4, 3, "none", data_parallel)
    plan_b = _plan(4, 2, 1, "1d", megatron_dp)
    plan_c = _plan(2, 2, 2, "none", data_parallel)
    four = run_world(4, save_then_move, plan_a, plan_b, path, timeout=600)[0]
    two = run_world(2, load_elsewhere, plan_c, path, timeout=600)[0]
    return four, two


@pytest.fixture(scope="module")
def moved_mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """bfloat16 compute with float32 master weights: dp=4 ZeRO-2 saved, dp=2 x tp=2 ZeRO-3 resumed."""
    path = str(tmp_path_factory.mktemp("ckpt") / "gpt-bf16")
    plan_a = _plan(4, 4, 2, "none", data_parallel, torch.bfloat16)
    plan_b = _plan(4, 2, 3, "1d", megatron_dp, torch.bfloat16)
    return run_world(4, save_then_move, plan_a, plan_b, path, torch.bfloat16, timeout=600)[0]  # type: ignore[no-any-return]


def test_float32_master_weights_move_bitwise_with_bf16_parameters(moved_mixed) -> None:  # type: ignore[no-untyped-def]
    assert moved_mixed["has_masters"]
    assert moved_mixed["params_bitwise"] and moved_mixed["states_bitwise"]
    assert abs(moved_mixed["resumed"] - moved_mixed["uninterrupted"]) <= 1e-2 * abs(moved_mixed["uninterrupted"])


def test_parameters_and_optimizer_states_move_bitwise_between_plans(moved) -> None:  # type: ignore[no-untyped-def]
    four, two = moved
    assert four["has_states"]
    assert four["params_bitwise"] and four["states_bitwise"]
    assert two["params_bitwise"] and two["states_bitwise"]


def test_training_resumes_with_the_uninterrupted_loss(moved) -> None:  # type: ignore[no-untyped-def]
    four, two = moved
    assert abs(four["resumed"] - four["uninterrupted"]) <= 1e-9 * abs(four["uninterrupted"])
    assert abs(two["resumed"] - four["uninterrupted"]) <= 1e-9 * abs(four["uninterrupted"])


def test_the_progress_saved_comes_back_on_load(moved) -> None:  # type: ignore[no-untyped-def]
    four, _ = moved
    assert four["progress"] == {"step": 2, "extra": {"loader": {"epoch": 0, "batch": 8}}}


def test_each_parameter_is_stored_as_the_shards_its_ranks_held(moved) -> None:  # type: ignore[no-untyped-def]
    """Written under dp=4 ZeRO-3: a parameter split 4 ways is 4 chunks of its shard's shape (each
    written by its holder, none gathered); a replicated one, one chunk (written once)."""
    four, _ = moved
    split = 0
    for attr, (stored, mine, full) in four["chunks"].items():
        assert all(shape == mine for shape in stored), (attr, stored, mine)
        assert len(stored) * torch.Size(mine).numel() == torch.Size(full).numel(), (attr, stored, full)
        split += len(stored) == 4
    assert split >= len(four["chunks"]) // 2, four["chunks"]


def test_save_and_load_hold_the_ranks_own_state_and_one_buffer(moved) -> None:  # type: ignore[no-untyped-def]
    """dp=4 ZeRO-3 writes, dp=2 x tp=2 ZeRO-1 reads: no rank allocates more than one tensor's worth
    while saving (nothing gathered), nor more than the states it loads plus one tensor while loading."""
    four, _ = moved
    assert four["save_peak"] <= four["held_a"]["largest"] + 256 * 1024, (four["save_peak"], four["held_a"])
    assert four["load_peak"] <= four["held_b"]["states"] + four["held_a"]["largest"] + 256 * 1024, (four["load_peak"], four["held_b"])
