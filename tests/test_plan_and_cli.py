"""Plans round-trip exactly through JSON; the CLI and the API plan presets and refuse bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from planner import auto_parallelize
from planner.cli import main
from planner.config import SearchConfig
from planner.hardware import A100_80G
from planner.models import build_model, example_inputs
from planner.plan import Plan
from planner.search import search
from planner.trace import trace
from planner.units import parse_bytes


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    model = build_model("gpt-tiny")
    args, kwargs = example_inputs("gpt-tiny", batch=4)
    result = search(trace(model, args, kwargs), SearchConfig(devices=4, dp=2, objective="memory", front=False), model_name="gpt-tiny")
    assert result.best is not None
    return result.best


def test_plan_round_trips_through_json_exactly(tiny_plan: Plan) -> None:
    again = Plan.model_validate_json(tiny_plan.model_dump_json())
    assert again == tiny_plan
    assert again.model_dump_json() == tiny_plan.model_dump_json()


def test_plan_nodes_carry_module_paths_and_strategies_read_per_module(tiny_plan: Plan) -> None:
    """Every op of a layer names its module; strategies_by_module reads like the model (the
    repeated blocks once, as h.*) and agrees with the nodes it summarises."""
    by_name = {n.name: n for n in tiny_plan.nodes}
    assert by_name["linear"].module == "h.0.attn.q_proj" and by_name["linear_6"].module == "h.1.attn.q_proj"
    assert by_name["embedding"].module == "wte"
    strategies = tiny_plan.strategies_by_module()
    assert list(strategies)[:3] == ["arange", "wte", "wpe"]
    assert "h.*.attn.q_proj" in strategies and "h.*.mlp.fc" in strategies and "lm_head" in strategies
    assert not any(".0." in key or ".1." in key for key in strategies)  # two blocks, listed once
    assert strategies["h.*.attn.q_proj"] == by_name["linear"].algorithm == by_name["linear_6"].algorithm
    assert strategies["lm_head"] == next(n.algorithm for n in tiny_plan.nodes if n.module == "lm_head")
    # a plan saved before nodes had module paths still loads (module "")
    data = json.loads(tiny_plan.model_dump_json())
    for node in data["nodes"]:
        del node["module"]
    assert all(n.module == "" for n in Plan.model_validate(data).nodes)


def test_plan_is_frozen_and_rejects_unknown_fields(tiny_plan: Plan) -> None:
    with pytest.raises(ValidationError, match="frozen"):
        tiny_plan.step_time_s = 0.0  # type: ignore[misc]
    data = json.loads(tiny_plan.model_dump_json())
    data["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        Plan.model_validate(data)


def test_plan_memory_breakdown_adds_up_to_peak(tiny_plan: Plan) -> None:
    assert tiny_plan.memory_breakdown.total == pytest.approx(tiny_plan.peak_memory_bytes, abs=5)
    assert tiny_plan.mesh == {"dp": 2, "tp": 2}


def test_least_memory_plan_shards_parameters_four_ways(tiny_plan: Plan) -> None:
    model = build_model("gpt-tiny")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # tp=2 can at best halve the parameters; dp never shards them (ZeRO is not built yet)
    assert tiny_plan.memory_breakdown.params <= param_bytes / 2 * 1.1


def test_cli_json_has_the_documented_fields(capfd: pytest.CaptureFixture[str]) -> None:
    """The whole of stdout is the JSON: captured at the file descriptor, where a solver's own
    prints (HiGHS writes to descriptor 1 from C) would land too."""
    assert main(["report", "gpt3-1.3b", "--devices", "8", "--tp", "none,1d", "--zero", "0", "--json"]) == 0
    doc = json.loads(capfd.readouterr().out)
    assert doc["pareto"], doc
    for entry in doc["pareto"]:
        assert set(entry) >= {"step_time_s", "peak_memory_bytes", "memory_breakdown", "mesh", "tp", "zero_stage", "cdp"}
        assert set(entry["memory_breakdown"]) == {"params", "grads", "optimizer", "activations", "transient", "step_transient", "peak_at"}
        assert entry["peak_memory_bytes"] <= 80 * 2**30
    steps = [e["step_time_s"] for e in doc["pareto"]]
    mems = [e["peak_memory_bytes"] for e in doc["pareto"]]
    assert steps == sorted(steps) and mems == sorted(mems, reverse=True)


def test_cli_text_report_names_the_best_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "gpt2-small", "--devices", "4", "--tp", "1d", "--zero", "0", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "best" in out and "Plan: mesh dp=" in out and "Collectives per device per step" in out


def test_cli_searches_cdp_and_prunes_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "gpt-tiny", "--devices", "8", "--tp", "none,1d", "--zero", "0,2", "--cdp", "off,v1", "--cdp-stages", "2", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 x tp=8 ZeRO-0 CDP v1: CDP runs over the data-parallel axis: needs dp > 1" in out
    rows = [line.split() for line in out.splitlines()]  # CDP runs with ZeRO 0-3: its ZeRO-2 configuration is planned
    assert any(r[:3] == ["dp=8", "x", "tp=1"] and r[4:7] == ["2", "v1,", "2"] and r[-1] == "optimal" for r in rows), out
    assert " v1 " in out


def test_zero_3_makes_gpt3_175b_fit_on_64_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "gpt3-175b", "--devices", "64", "--tp", "1d", "--zero", "0,3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = next(e for e in doc["pareto"] if e["best"])
    assert best["zero_stage"] == 3 and best["peak_memory_bytes"] <= 80 * 2**30
    assert not any(c["feasible"] for c in doc["candidates"] if c["zero_stage"] == 0)


def test_cli_tp_3d_with_dp_1_plans_pure_3d_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "gpt3-1.3b", "--devices", "64", "--tp", "3d", "--dp", "1", "--best-only", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pareto"] and all(e["mesh"] == {"dp": 1, "i": 4, "j": 4, "k": 4} for e in doc["pareto"])
    assert all(e["tp"] == "3d" for e in doc["pareto"])


def test_infeasible_budget_says_by_how_much(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "gpt3-175b", "--devices", "64", "--tp", "1d", "--zero", "0"]) == 1
    out = capsys.readouterr().out
    assert "no plan on mesh dp=8 x tp=8 fits 80.00 GiB per device" in out
    assert "GiB over" in out


def test_parse_bytes_reads_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40e9") == 40e9
    assert parse_bytes("16 GB") == 16e9


def test_auto_parallelize_outside_torchrun_returns_the_plan_and_report() -> None:
    model = build_model("mlp-tiny", device="meta")
    args, kwargs = example_inputs("mlp-tiny", batch=8, device="meta")
    result = auto_parallelize(model, devices=4, example_inputs=args, example_kwargs=kwargs)
    assert result.plan is not None and result.plan.mesh["dp"] * result.plan.mesh["tp"] == 4
    assert "planner report" in str(result)


def test_auto_parallelize_requires_devices_outside_torchrun() -> None:
    model = build_model("mlp-tiny", device="meta")
    with pytest.raises(ValueError, match="devices is required"):
        auto_parallelize(model, example_inputs=(None,))


BAD_REPORTS = [  # (arguments after `report mlp-tiny --devices 4`, what stderr must say)
    (["--memory", "0"], "must be > 0 bytes per device"),
    (["--devices", "7", "--tp", "2d"], "no mesh of tp 2d tiles 7 devices"),
    (["--tp", "3d"], "no mesh of tp 3d tiles 4 devices"),
    (["--tp", "none", "--dp", "2"], "no mesh of tp none tiles 4 devices with dp = 2"),
    (["--tp", ","], "names nothing"),
    (["--zero", ""], "names nothing"),
    (["--time-limit", "0"], "--time-limit 0 must be > 0 seconds"),
    (["--save-plan", "/nonexistent-folder/plan.json"], "--save-plan /nonexistent-folder/plan.json: the folder"),
    (["--plot", "/nonexistent-folder/front.png"], "--plot /nonexistent-folder/front.png: the folder"),
]


@pytest.mark.parametrize(("extra", "says"), BAD_REPORTS, ids=[" ".join(a) for a, _ in BAD_REPORTS])
def test_cli_bad_input_is_one_line_exit_2_before_any_search(extra: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's mistake: exit code 2, the input named on stderr, no traceback, and nothing
    searched first (the output paths and the search space are checked before the model is traced)."""
    import planner.search

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched before the input was checked")

    monkeypatch.setattr(planner.search, "search", no_search)
    try:
        code = main(["report", "mlp-tiny", "--devices", "4", *extra])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err


def test_calibrate_into_a_missing_folder_fails_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--out", "/nonexistent-folder/profile.json", "--quick"]) == 2
    assert "--out /nonexistent-folder/profile.json: the folder" in capsys.readouterr().err


def test_a_search_configuration_rejects_a_budget_of_nothing_and_an_empty_space() -> None:
    with pytest.raises(ValueError, match="memory_budget = 0: Input should be greater than 0"):
        SearchConfig.build(devices=4, memory_budget=0)
    with pytest.raises(ValueError, match="no mesh of tp 2d tiles 6 devices"):
        SearchConfig.build(devices=6, tp=("2d",))
    with pytest.raises(ValueError, match=r"tp = \(\): Tuple should have at least 1 item"):
        SearchConfig.build(devices=4, tp=())


def test_api_takes_options_as_a_user_writes_them_and_names_the_wrong_ones() -> None:
    """zero=3, tp="1d" (one value) and memory_budget="40GiB" mean what they say; a wrong type or
    range is an error naming the argument, before anything is traced."""
    from planner.api import plan_model

    model = build_model("mlp-tiny", device="meta")
    args, kwargs = example_inputs("mlp-tiny", batch=8, device="meta")
    result = plan_model(model, devices=4, example_inputs=args, example_kwargs=kwargs, tp="none,1d", zero=1, memory_budget="40GiB", front=False)
    assert result.plan is not None and result.search.memory_budget == 40 * 2**30
    assert {c.zero for c in result.search.candidates if c.mesh.degree("dp") > 1} == {1} and {c.family for c in result.search.candidates} <= {"none", "1d"}
    for bad, match, error in (({"devices": "8"}, "devices must be an int", TypeError), ({"zero": 2.5}, "zero.0 = 2.5: Input should be 0, 1, 2 or 3", ValueError),
                              ({"tp": 3}, "tp.0 = 3", ValueError), ({"resolution": 5}, "resolution = 5: Input should be less than 1", ValueError),
                              ({"max_points": 0}, "max_points = 0", ValueError), ({"workers": 0}, "workers 0", ValueError),
                              ({"dp": 1, "zero": 3}, "dp = 1 leaves none", ValueError), ({"memory_budget": 0}, "memory_budget = 0: Input should be greater than 0", ValueError),
                              ({"zeros": (1,)}, "unknown key 'zeros'", ValueError)):
        options = {"devices": 4, **bad}
        with pytest.raises(error, match=match):
            plan_model(model, example_inputs=args, example_kwargs=kwargs, **options)  # type: ignore[arg-type]


def test_plan_files_are_checked_not_trusted(tiny_plan: Plan) -> None:
    """A plan from a newer planner, or one whose nodes were renamed, is refused with what to do
    (not a KeyError halfway through compiling)."""
    from planner.runtime.compile import compile_plan

    data = json.loads(tiny_plan.model_dump_json())
    data["version"] = 99
    with pytest.raises(ValidationError, match="plan version 99: this planner reads version 1"):
        Plan.model_validate(data)
    data = json.loads(tiny_plan.model_dump_json())
    renamed = next(n for n in data["nodes"] if n["name"] == "linear")
    renamed["name"] = "linear_renamed"
    args, kwargs = example_inputs("gpt-tiny", batch=4)
    with pytest.raises(ValueError, match=r"does not match the traced graph: nodes \['linear'\].*'linear_renamed'"):
        compile_plan(Plan.model_validate(data), build_model("gpt-tiny"), args, kwargs, mesh_groups=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(("extra", "says"), [
    (["--micro-batches", "3"], "no configuration of this search can run: batch 8 does not split into 3 micro-batches x 4 ways"),
    (["--devices", "1", "--cdp", "v1"], "CDP runs over the data-parallel axis: needs dp > 1"),
    (["--batch", "12", "--dp", "8", "--devices", "8"], "batch 12 does not split 8 ways"),
], ids=["micro-batches 3 on batch 8", "cdp on one device", "batch 12 over dp 8"])
def test_a_search_that_cannot_run_says_why_not_that_memory_is_short(extra: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Options that leave no configuration to solve exit 2 with the reasons, not exit 1 with "no
    plan fits the memory budget" (exit 1 is for memory)."""
    assert main(["report", "mlp-tiny", "--devices", "4", *extra]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and "memory budget" not in captured.err and not captured.out


FACTORIES = '''
import torch


class Sum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x).sum()


def wrong_shapes(batch):
    return Sum(), (torch.randn(batch, 5),), {}


def raises(batch):
    raise RuntimeError("factory broke")


def no_tuple(batch):
    return Sum()


not_callable = 3
'''


@pytest.mark.parametrize(("factory", "says"), [
    ("wrong_shapes", "could not trace Sum with torch.export (non-strict): RuntimeError: a and b must have same reduction dim"),
    ("raises", "the model factory user_factories:raises(8) raised RuntimeError: factory broke"),
    ("no_tuple", "must return (model, args, kwargs) with model a torch.nn.Module; got Sum"),
    ("not_callable", "user_factories:not_callable is a int, not a factory"),
    ("missing", "cannot load model factory 'user_factories:missing'"),
])
def test_a_bad_model_factory_is_a_short_error(factory: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's package.module:factory that raises, is not callable, returns the wrong thing or
    traces with wrong shapes: exit 2 and the planner's own few lines (torch's logged traceback of
    the failing op held back)."""
    (tmp_path / "user_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["report", f"user_factories:{factory}", "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) <= 4, err


def test_hardware_files_version_and_counts_read_as_a_person_expects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A partial or empty hardware profile is one line naming its fields (not pydantic's dump, not
    min() of an empty sequence); calibrate needs 2 processes; --version answers; a tiny model's
    size is a count (1.9 K values), not 0.000 B."""

    partial = tmp_path / "partial.json"
    partial.write_text('{"name": "mine"}')
    empty = tmp_path / "empty.json"
    empty.write_text(A100_80G.model_copy(update={"peak_flops": {}}).model_dump_json())
    for path, says in ((partial, "device_memory: Field required"), (empty, "peak_flops: Dictionary should have at least 1 item")):
        assert main(["report", "mlp-tiny", "--devices", "2", "--hardware", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"hardware profile file {path} is not a profile: " in err and says in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--out", str(tmp_path / "p.json"), "--world", "0"])
    assert exc.value.code == 2 and "--world 0 must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("planner ")
    assert main(["report", "mlp-tiny", "--devices", "2", "--tp", "none"]) == 0
    assert "6 parameters (1.9 K values)" in capsys.readouterr().out
