"""Planning never fails in a way a user cannot act on: drawn device counts, memory budgets and
search options (hypothesis) give a plan within the budget, an infeasible answer that says by how
much, or a ValueError/TypeError that names the input, within a stated time per draw."""

from __future__ import annotations

import functools
import time

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from planner.config import ALL_TP, SearchConfig
from planner.ir import IRGraph
from planner.models import build_model, example_inputs
from planner.search import search
from planner.trace import trace

# mlp-tiny's searches on up to 8 devices take 0.1-30 s on 2 cores (the slowest: every family, ZeRO stage and
# micro-batch count with CDP and a front, 30 s beside another test run); a draw past this is a finding. (On 16
# devices the whole space with every micro-batch count and a front took 67 s beside another test run:
# issue 18's search speed, not a wrong answer.) The host of 2026-12-06 runs the same code slower: the slowest
# draw (8 devices, a front, the memory objective, 1-D/2-D/dp with ZeRO 0-3, CDP and recomputation) took
# 64-80 s alone, at this commit and at the one before that day's changes (66.8 s), most of it the 2-D
# configurations' fronts (issue 18); 60 s, the bound before, failed there
SECONDS_PER_DRAW = 120.0
MODELS = ("mlp-tiny",)


@functools.cache
def traced(name: str) -> IRGraph:
    model = build_model(name, device="meta")
    args, kwargs = example_inputs(name, batch=8, device="meta")
    return trace(model, args, kwargs)


def _subset(values: tuple[object, ...]) -> st.SearchStrategy[tuple[object, ...]]:
    return st.lists(st.sampled_from(values), min_size=1, max_size=len(values), unique=True).map(tuple)


# no shrinking: a failing draw is printed as drawn (shrinking re-runs searches for minutes)
@settings(max_examples=400, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(
    model=st.sampled_from(MODELS),
    devices=st.integers(1, 8),
    budget=st.one_of(st.none(), st.floats(1e3, 1e9)),
    tp=_subset(ALL_TP),
    zero=_subset((0, 1, 2, 3)),
    cdp=_subset(("off", "v1", "v2")),
    micro_batches=_subset((1, 2, 3, 4)),
    recompute=_subset(("none", "selective", "full")),
    recompute_layers=_subset((0.25, 0.5, 1.0)),
    dp=st.one_of(st.none(), st.integers(1, 8)),
    objective=st.sampled_from(("time", "memory", "knee")),
    front=st.booleans(),
)
def test_a_plan_within_budget_or_a_reason_never_another_exception(
    model: str, devices: int, budget: float | None, tp: tuple[str, ...], zero: tuple[int, ...],
    cdp: tuple[str, ...], micro_batches: tuple[int, ...], recompute: tuple[str, ...], recompute_layers: tuple[float, ...], dp: int | None,
    objective: str, front: bool,
) -> None:
    t0 = time.perf_counter()
    try:
        config = SearchConfig.build(devices=devices, tp=tp, zero=zero, cdp=cdp, micro_batches=micro_batches, recompute=recompute,
                                    recompute_layers=recompute_layers, dp=dp, memory_budget=budget, objective=objective, front=front,
                                    time_limit_s=10.0)
        result = search(traced(model), config, model_name=model)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert len(message) > 20 and "\n" not in message, message  # one line that names the input
        return
    finally:
        assert time.perf_counter() - t0 < SECONDS_PER_DRAW, (devices, budget, tp, zero, cdp, micro_batches, dp)
    if result.best is not None:
        assert result.best.peak_memory_bytes <= result.memory_budget
        assert all(p.peak_memory_bytes <= result.memory_budget for p in result.front)
    else:  # nothing fits: the answer says so, and by how much
        assert result.infeasible, (devices, budget, tp, zero, cdp, micro_batches, dp)
        assert "over" in result.infeasible or "fits" in result.infeasible, result.infeasible
