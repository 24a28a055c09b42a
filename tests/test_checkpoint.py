"""Checkpoints (torch.distributed.checkpoint): atomic writes, and state that moves between plans and world sizes.

Saved under dp=4 ZeRO-3 on 4 ranks after two AdamW steps; resumed under dp=2 x tp=2 ZeRO-1 on the
same 4 ranks and under dp=2 ZeRO-2 on 2 ranks: parameters and optimizer states equal the saved
ones bit for bit after the move, and the next step's loss equals the uninterrupted run's (1e-9).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime.checkpoint as ckpt
from models import build_model, example_inputs
from planner.hardware import A100_80G
from planner.search import SearchSpace, search
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
    with pytest.raises(ckpt.dcp.api.CheckpointException):
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


def _plan(devices: int, dp: int, zero: int, family: str, allow: Any, dtype: torch.dtype = torch.float64) -> str:
    model = build_model(MODEL, dtype=dtype)
    args, kwargs = example_inputs(MODEL, batch=4, dtype=dtype)
    master = "float32" if dtype == torch.bfloat16 else None
    result = search(trace(model, args, kwargs), SearchSpace(devices=devices, dp=dp, zero=(zero,), tp=(family,)), A100_80G,
                    model_name=MODEL, allow=allow, master_dtype=master, front=False)
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
    from runtime.compile import compile_plan

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
    _, metadata = ckpt.checkpoint_metadata(path)
    stored = metadata.state_dict_metadata
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
    from runtime.compile import compile_plan

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
