"""The search configuration (planner/config.py): one frozen value, from flags, Python or a file,
stored in every plan, and a run repeated from it gives the same front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from planner.cli import main
from planner.config import SearchConfig
from planner.hardware import A100_80G
from planner.models import build_model, example_inputs
from planner.plan import Plan


def test_a_configuration_reads_back_equal_from_its_toml_and_json(tmp_path: Path) -> None:
    config = SearchConfig(devices=64, zero="0,1,2,3", recompute=("none", "full"), tp="1d", max_points=None, memory_budget="40GiB",
                          master_dtype="float32", dp=8)
    assert config.zero == (0, 1, 2, 3) and config.tp == ("1d",) and config.memory_budget == 40 * 2**30
    (tmp_path / "s.toml").write_text(config.to_toml())
    assert SearchConfig.load(tmp_path / "s.toml") == config
    # a calibrated profile (no preset equals it) travels whole in JSON
    calibrated = config.model_copy(update={"hardware": A100_80G.model_copy(update={"name": "calibrated-gpu", "op_overhead": 7e-6})})
    (tmp_path / "s.json").write_text(calibrated.model_dump_json())
    assert SearchConfig.load(tmp_path / "s.json") == calibrated
    assert "calibrated-gpu" in calibrated.to_toml() and 'hardware = "' not in calibrated.to_toml()
    with pytest.raises(ValidationError, match="frozen"):
        config.devices = 8  # type: ignore[misc]


def test_bad_keys_and_values_are_named_with_what_there_is(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("devices = 8\nzeros = [0, 3]\n")
    with pytest.raises(ValueError, match=r"bad.toml: unknown key 'zeros' \(known: devices, hardware, .*zero,"):
        SearchConfig.load(tmp_path / "bad.toml")
    (tmp_path / "bad2.toml").write_text('devices = 8\ntp = ["1d", "4d"]\nresolution = 2\n')
    with pytest.raises(ValueError, match=r"tp.1 = '4d': Input should be 'none', '1d', '2d' or '3d'; resolution = 2"):
        SearchConfig.load(tmp_path / "bad2.toml")
    (tmp_path / "broken.toml").write_text("devices = \n")
    with pytest.raises(ValueError, match=r"broken\.toml is not TOML"):
        SearchConfig.load(tmp_path / "broken.toml")
    with pytest.raises(ValueError, match=r"^the search configuration: dp = 3 does not divide devices = 8$"):  # a rule across keys, in its own words
        SearchConfig.build(devices=8, dp=3)


def test_every_plan_carries_the_configuration_and_plan_model_takes_one() -> None:
    from planner.api import plan_model

    model = build_model("mlp-tiny", device="meta")
    args, kwargs = example_inputs("mlp-tiny", batch=8, device="meta")
    config = SearchConfig(devices=4, tp=("none", "1d"), zero=(0, 1))
    by_config = plan_model(model, example_inputs=args, example_kwargs=kwargs, config=config)
    by_keywords = plan_model(model, devices=4, example_inputs=args, example_kwargs=kwargs, tp="none,1d", zero=(0, 1))
    result = by_config.search
    assert result.config == config and by_keywords.search.config == config
    plans = [result.best, result.knee, *result.front, *(p for c in result.candidates for p in c.front)]
    assert plans and all(p is not None and p.search_config == config for p in plans)
    assert result.best in result.front and any(result.best is p for p in result.front)  # the same objects, stamped once
    assert [(p.step_time_s, p.peak_memory_bytes) for p in result.front] == [(p.step_time_s, p.peak_memory_bytes) for p in by_keywords.search.front]
    best = result.best
    assert best is not None and Plan.model_validate_json(best.model_dump_json()) == best
    # keywords beside config= win over it
    narrowed = plan_model(model, example_inputs=args, example_kwargs=kwargs, config=config, zero=1, front=False)
    assert narrowed.search.config is not None and narrowed.search.config.zero == (1,) and narrowed.search.config.tp == ("none", "1d")


def test_report_config_repeats_a_saved_plans_search_and_flags_win(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "plan.json"
    assert main(["report", "mlp-tiny", "--devices", "4", "--tp", "none,1d", "--zero", "0,1", "--save-plan", str(saved), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["search_config"]["zero"] == [0, 1] and first["search_config"]["hardware"]["name"] == "a100-80g"
    assert first["search_config"]["hardware"]["device_memory"] == A100_80G.device_memory  # the profile itself, not only its name
    assert Plan.model_validate_json(saved.read_text()).search_config == SearchConfig(devices=4, tp=("none", "1d"), zero=(0, 1))
    assert main(["report", "mlp-tiny", "--config", str(saved), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert [(p["step_time_s"], p["peak_memory_bytes"], p["mesh"], p["zero_stage"]) for p in again["pareto"]] == \
           [(p["step_time_s"], p["peak_memory_bytes"], p["mesh"], p["zero_stage"]) for p in first["pareto"]]
    assert main(["report", "mlp-tiny", "--config", str(saved), "--zero", "1", "--devices=8", "--json"]) == 0
    narrowed = json.loads(capsys.readouterr().out)
    assert narrowed["search_config"]["zero"] == [1] and narrowed["search_config"]["devices"] == 8 and narrowed["search_config"]["tp"] == ["none", "1d"]
    # the verbose report prints the configuration as a file that repeats it
    assert main(["report", "mlp-tiny", "--config", str(saved), "--verbose"]) == 0
    text = capsys.readouterr().out
    toml = text.split("repeats this search):\n", 1)[1]
    (tmp_path / "search.toml").write_text(toml)
    assert SearchConfig.load(tmp_path / "search.toml") == SearchConfig(devices=4, tp=("none", "1d"), zero=(0, 1))


def test_every_scheme_has_its_setting_where_it_is_searched_stored_and_built() -> None:
    """A scheme declares its setting once (planner/schemes/base.py): the search's configurations,
    build_problem's keywords, a problem's settings and a plan's follow from the declaration, and
    the setting must be a field where it is searched (SearchConfig) and stored for the runtime
    (Plan), with the scheme off by default everywhere; its flags set SearchConfig fields, and it
    names its column in the report. A scheme half added fails here, naming what it lacks."""
    from planner.cli import _parser
    from planner.mesh import Mesh
    from planner.problem import build_problem
    from planner.schemes.base import OFF
    from planner.schemes.registry import SCHEMES
    from planner.space import candidate_meshes
    from planner.trace import trace

    args = _parser().parse_args(["report", "mlp-tiny", "--devices", "8"])
    for scheme in SCHEMES:
        assert scheme.setting in OFF and OFF[scheme.setting] == scheme.off, scheme.name
        assert scheme.searched in SearchConfig.model_fields, f"{scheme.name}: SearchConfig has no field {scheme.searched!r}"
        assert SearchConfig(devices=8).model_dump()[scheme.searched] == (scheme.off,), f"{scheme.name}: a search tries it off by default"
        assert Plan.model_fields[scheme.setting].default == scheme.off, f"{scheme.name}: Plan.{scheme.setting} is off by default"
        assert scheme.column and scheme.title, f"{scheme.name}: a column and a title for the reports"
        assert scheme.searched in {flag.field for flag in scheme.flags}, f"{scheme.name}: a flag sets SearchConfig.{scheme.searched}"
        for flag in scheme.flags:
            assert flag.field in SearchConfig.model_fields, f"{scheme.name}: {flag.name} sets SearchConfig.{flag.field}, which is no field"
            default = SearchConfig.model_fields[flag.field].default
            assert getattr(args, flag.dest) == (False if flag.switch_off else default), f"{flag.name}'s default is SearchConfig's"
    # a configuration holds every scheme's setting, and they build its problem and name its plan
    cand = candidate_meshes(SearchConfig(devices=4, tp=("none",), zero=(1,), micro_batches=(2,)), batch=8)[0]
    assert dict(cand.settings) == {"zero_stage": 1, "cdp": "off", "micro_batches": 2, "recompute": "none"} and not cand.reason
    graph = trace(build_model("mlp-tiny", device="meta"), *example_inputs("mlp-tiny", batch=4, device="meta"))
    problem = build_problem(graph, Mesh(("dp", "tp"), (4, 1)), A100_80G, **cand.settings)
    assert problem.settings == cand.settings and (problem.zero_stage, problem.micro_batches) == (1, 2)
    with pytest.raises(TypeError, match="build_problem got zero: the schemes' settings are zero_stage, "):
        build_problem(graph, Mesh(("dp", "tp"), (4, 1)), A100_80G, zero=1)
