"""`planner report` shows the time/memory front (text, markdown, JSON, plot) and `planner explain`
says why one point: on mlp-tiny over 8 devices (DP and 1-D TP, ZeRO 0/1), a search of about a second."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.config import SearchConfig
from planner.explain import collective_seconds, explain, peak_phase
from planner.hardware import A100_80G
from planner.models import build_model, example_inputs
from planner.search import SearchResult, _Pace, search
from planner.trace import trace

TINY = ["mlp-tiny", "--devices", "8", "--tp", "none,1d", "--zero", "0,1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_search() -> SearchResult:
    model = build_model("mlp-tiny", device="meta")
    args, kwargs = example_inputs("mlp-tiny", batch=8, device="meta")
    space = SearchConfig(devices=8, tp=("none", "1d"), zero=(0, 1))
    return search(trace(model, args, kwargs), space, model_name="mlp-tiny")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def front_table(out: str) -> list[str]:
    """The rows of the text front table: from under its dashed rule to the first blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  ")) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start:end]


def test_report_prints_the_front_table_fastest_first_with_knee_and_best_marked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY)
    assert code == 0
    rows = front_table(out)
    assert len(rows) >= 3, out
    assert [int(r.split()[0]) for r in rows] == list(range(1, len(rows) + 1))
    assert sum("knee" in r for r in rows) == 1 and sum("best" in r for r in rows) == 1
    assert "best" in rows[0]  # objective time: the fastest point
    assert "one step's global batch" in out
    assert "--verbose prints each one" in out and "Configurations (" not in out and "Strategies" not in out
    code, verbose, _ = run(capsys, "report", *TINY, "--verbose")
    assert code == 0
    for column in ("points", "on front", "fastest", "least memory", "status"):
        assert column in verbose  # the per-configuration table under the front
    assert verbose.index("Chosen plan") < verbose.index("Time/memory front") < verbose.index("Configurations (") < verbose.index("Plan: mesh")


def test_the_report_answers_first(capsys: pytest.CaptureFixture[str]) -> None:
    """The chosen plan and how to run it come first, within 15 lines: the command that saves it
    (this one's options, --save-plan added) and the code that runs it."""
    code, out, _ = run(capsys, "report", *TINY, "--progress")
    assert code == 0
    head = out.splitlines()[:15]
    assert head[1].startswith("Chosen plan (time): mesh ")
    run_line = next(line for line in head if "Run it:" in line)
    assert run_line.strip() == "Run it: planner report " + " ".join(TINY) + " --save-plan plan.json"
    assert any("compile_plan(Plan.model_validate_json(open('plan.json').read()), model, *batch)" in line for line in head)
    assert max(len(line) for line in head[:4]) <= 160


def test_markdown_prints_github_tables(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY, "--markdown", "--verbose")
    assert code == 0
    assert "| # | step time | memory/device | mesh | tp | zero | cdp | micro-batches | recompute |  |" in out
    assert "| mesh | tp | zero | cdp | micro-batches | recompute | points | on front | fastest | its memory | least memory | status |" in out
    assert out.count("| --- |") >= 2
    assert "| knee |" in out or ", knee |" in out


def test_micro_batch_counts_are_searched_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """--micro-batches 1,2: every configuration in each count (the table's micro-batches column),
    a count the batch does not split into pruned with its reason, and the JSON says each point's."""
    code, out, _ = run(capsys, "report", *TINY, "--batch", "4", "--micro-batches", "1,2,8", "--verbose")
    assert code == 0
    assert "split into 1, 2, 8 micro-batches for gradient accumulation" in out
    assert "does not split into 8 micro-batches" in out
    code, out, _ = run(capsys, "report", *TINY, "--batch", "4", "--micro-batches", "1,2", "--json")
    doc = json.loads(out)
    assert {c["micro_batches"] for c in doc["candidates"]} == {1, 2}
    assert any(c["micro_batches"] == 2 and c["status"] != "pruned" for c in doc["candidates"])  # searched, not skipped
    assert all(p["micro_batches"] in (1, 2) for p in doc["pareto"])
    code, out, _ = run(capsys, "explain", *TINY, "--batch", "4", "--micro-batches", "1,2")
    assert code == 0 and "    micro-batches " in out  # the other count among the alternatives


def test_plot_writes_a_png_and_says_where_on_stderr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "front.png"
    code, out, err = run(capsys, "report", *TINY, "--plot", str(path))
    assert code == 0
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    assert f"wrote the front plot to {path}" in err and str(path) not in out


def test_json_front_is_non_dominated_fastest_first_and_marks_one_knee(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY, "--json")
    assert code == 0
    doc = json.loads(out)
    front = doc["pareto"]
    assert doc["objective"] == "time" and doc["infeasible"] == ""
    times = [e["step_time_s"] for e in front]
    mems = [e["peak_memory_bytes"] for e in front]
    assert times == sorted(times) and all(a > b for a, b in itertools.pairwise(mems))
    assert [e["knee"] for e in front].count(True) == 1 and front[0]["best"]
    assert all(e["strategies"] and all(isinstance(v, str) and v for v in e["strategies"].values()) for e in front)
    every = [(p["step_time_s"], p["peak_memory_bytes"]) for c in doc["candidates"] for p in c["front"]]
    for e in front:  # no point any configuration found beats a front point on both axes
        assert not any(t <= e["step_time_s"] and m <= e["peak_memory_bytes"] and (t, m) != (e["step_time_s"], e["peak_memory_bytes"])
                       for t, m in every)
    for c in doc["candidates"]:
        assert c["front_points"] == len(c["front"]) and (c["front_points"] > 0) == c["feasible"]
    # the default resolution, 5 %: each point needs at least 5 % less memory than the one before,
    # the merged front's and each configuration's (but for a configuration's least-memory plan, kept
    # at its end for the merge across configurations: planner.sweep.sweep)
    assert all(b <= a * 0.95 for a, b in itertools.pairwise(mems)), mems
    for c in doc["candidates"]:
        own = [p["peak_memory_bytes"] for p in c["front"]]
        assert all(b <= a * 0.95 for a, b in itertools.pairwise(own[:-1])), own
        assert all(b < a for a, b in itertools.pairwise(own)), own


def test_workers_find_the_same_exact_front(capsys: pytest.CaptureFixture[str]) -> None:
    """--workers 2 solves configurations in two forked processes; with the exact front asked for
    (resolution 0, no cap that binds) the front is the serial one; a bad count names the option."""
    fronts = []
    for workers in ("1", "2"):
        code, out, _ = run(capsys, "report", *TINY, "--json", "--resolution", "0", "--max-points", "100", "--workers", workers)
        assert code == 0
        fronts.append([(e["step_time_s"], e["peak_memory_bytes"]) for e in json.loads(out)["pareto"]])
    assert len(fronts[0]) >= 2
    assert [m for _, m in fronts[1]] == [m for _, m in fronts[0]]
    assert [t for t, _ in fronts[1]] == pytest.approx([t for t, _ in fronts[0]], rel=1e-6)
    with pytest.raises(SystemExit):
        main(["report", *TINY, "--workers", "0"])
    assert "--workers 0 must be >= 1" in capsys.readouterr().err


def test_objective_knee_chooses_the_knee(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY, "--json", "--objective", "knee")
    assert code == 0
    chosen = [e for e in json.loads(out)["pareto"] if e["best"]]
    assert len(chosen) == 1 and chosen[0]["knee"]


def test_best_only_keeps_one_plan_per_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY, "--json", "--best-only")
    assert code == 0
    assert all(c["front_points"] <= 1 for c in json.loads(out)["candidates"])


def test_progress_goes_to_stderr_and_stdout_stays_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "report", *TINY, "--json", "--progress")
    assert code == 0
    json.loads(out)  # nothing but the document on stdout
    assert "[1/" in err and "traced mlp-tiny" in err and "front points" in err
    assert ", ETA " in err.splitlines()[1], err  # after the first configuration, the seconds left


def test_the_eta_weighs_what_is_left_by_each_configurations_size() -> None:
    """The seconds so far spread over the weight passed: 10 s for two configurations of weight 1
    leave 15 s for one of weight 3; none before the first or after the last."""
    pace = _Pace({0: 1.0, 1: 1.0, 2: 3.0})
    pace.start -= 10.0  # ten seconds in
    assert pace.eta_s() is None
    pace.passed(0)
    pace.passed(1)
    assert pace.eta_s() == pytest.approx(15.0, rel=0.01)
    pace.passed(2)
    assert pace.eta_s() is None


def test_no_progress_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "report", *TINY, "--json")
    assert code == 0 and "[1/" not in err


def test_nothing_fits_prints_the_least_memory_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", *TINY, "--memory", "1KiB")
    assert code == 1
    assert "No plan on 8 devices fits 1.0 KiB per device. The least memory any plan needs is" in out
    code, out, _ = run(capsys, "explain", *TINY, "--memory", "1KiB")
    assert code == 1 and "The least memory any plan needs is" in out


def test_explain_prints_strategy_time_memory_and_alternatives(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", *TINY, "--objective", "knee")
    assert code == 0
    assert out.startswith("Point ") and "(best, knee; objective knee)" in out
    sections = ["== Strategy ==", "== Where the time goes ==", "== Where the memory goes ==", "== Why not the alternatives =="]
    assert [out.index(s) for s in sections] == sorted(out.index(s) for s in sections)
    assert "Strategies (one line per distinct node" in out and "Top collectives by total time per step" in out
    assert "Neighbours on the front:" in out and ("ZeRO 0:" in out or "ZeRO 1:" in out)


def test_explain_point_indexes_the_front_table_and_refuses_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", *TINY, "--point", "2")
    assert code == 0 and out.startswith("Point 2 of ")
    code, _, err = run(capsys, "explain", *TINY, "--point", "99")
    assert code == 2 and "--point 99 is out of range: the front has" in err


def test_bad_resolution_names_the_option() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["report", *TINY, "--resolution", "1.5"])
    assert exc.value.code == 2


def test_explained_collectives_add_up_to_the_plans_communication_time(tiny_search: SearchResult) -> None:
    for plan in tiny_search.front:
        priced = [collective_seconds(r, plan, A100_80G) for r in plan.comms]
        assert None not in priced
        total = sum((s or 0.0) * r.count for s, r in zip(priced, plan.comms, strict=True))
        assert total == pytest.approx(plan.comm_time_s, rel=1e-9, abs=1e-12)


def test_memory_terms_held_at_the_peak_add_up_to_it(tiny_search: SearchResult) -> None:
    for plan in tiny_search.front:
        _, terms = peak_phase(plan)
        held = sum(getattr(plan.memory_breakdown, t) for t in terms)
        assert held == pytest.approx(plan.peak_memory_bytes, abs=8)


def test_explain_compares_with_the_neighbours_on_the_front(tiny_search: SearchResult) -> None:
    n = len(tiny_search.front)
    assert n >= 3
    middle = explain(tiny_search, A100_80G, point=2)
    assert "point 1 (faster" in middle and "more memory per device" in middle and "fits the 80.00 GiB budget" in middle
    assert "point 3 (smaller" in middle and "slower (+" in middle
    assert "no faster point" in explain(tiny_search, A100_80G, point=1)
    assert "no smaller point" in explain(tiny_search, A100_80G, point=n)


def test_a_least_memory_solve_stopped_by_the_time_limit_keeps_the_fastest_plan(capsys: pytest.CaptureFixture[str],
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """When the least-memory ILP finds nothing before --time-limit (3-D gpt-tiny on 8 devices:
    none in 2 s), the configuration keeps its fastest plan, marked "time limit", instead of a
    traceback; with no plan at all the report says which limit to raise."""
    import planner.solve as solve
    import planner.sweep as sweep

    real = solve.solve_once

    def stopped(problem, budget, objective, settings):  # type: ignore[no-untyped-def]
        if objective == "memory":
            raise solve.SolveStopped(f"the least-memory ILP of mesh {problem.mesh} found no plan within the time limit of 2 s: raise it (--time-limit)")
        return real(problem, budget, objective, settings)

    def least_stopped(problem, settings, ilp=None, gap=None):  # type: ignore[no-untyped-def]
        return stopped(problem, float("inf"), "memory", settings)

    monkeypatch.setattr(solve, "solve_once", stopped)
    monkeypatch.setattr(sweep, "least_memory", least_stopped)
    code, out, _ = run(capsys, "report", *TINY)
    assert code == 0 and out.splitlines()[1].startswith("Chosen plan (time): ")
    assert "time limit" in out, out
