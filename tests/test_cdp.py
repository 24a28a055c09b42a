"""Cyclic data parallelism (runtime/cdp.py): the update rules, the point-to-point traffic, and the
memory CDP saves, on 4 gloo ranks in float64 with SGD-momentum over 5 steps.

* ``sync`` (delta = 0: gradients summed along the chain, applied at once) equals ordinary DP
  (the compiled module with its all-reduce) to 1e-12;
* ``v1`` and ``v2`` equal serial single-process loops of their update rules (tests/cdp_checks.py
  ``reference``) to 1e-10, with dp=4 (mlp-tiny, gpt-tiny with its tied embedding) and with
  tensor parallelism inside each worker (dp=2 x Megatron tp=2);
* per stage per step: 2(N-1) point-to-point messages over all ranks and no collective over the
  data-parallel axis at all (planner/schemes/cdp.py: the position embedding's gradient stays partial, the
  cross-entropy counts locally);
* with N = 4 micro-batches sharing one process, the live saved-for-backward bytes are constant in
  time under CDP and equal (N/L) sum_l (L-l) A_l, against DP's peak N sum_l A_l.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch

from planner.cdp_clock import TOKEN_BYTES
from planner.config import SearchConfig
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import build_model, example_inputs
from planner.schemes.cdp import cdp_filter
from planner.schemes.tp import DP_AXIS
from planner.search import search
from planner.trace import trace
from tests.cdp_checks import BATCH, STEPS, cdp_barred, cdp_memory, cdp_pipeline, cdp_train
from tests.harness import run_world
from tests.test_same_math import data_parallel, megatron_dp


def _plan(name: str, dp: int, allow: Any, cdp: str = "off", stages: int = 4, zero: int = 0) -> str:
    """A plan whose workers are independent (planner/schemes/cdp.py); ``cdp`` != off plans CDP itself."""
    model = build_model(name, dtype=torch.float64)
    args, kwargs = example_inputs(name, batch=BATCH, dtype=torch.float64)
    space = SearchConfig(devices=4, dp=dp, zero=(zero,), tp=("none",) if dp == 4 else ("1d",), cdp=(cdp,), cdp_stages=stages,
                         optimizer="sgd-momentum", front=False)
    graph = trace(model, args, kwargs)
    result = search(graph, space, model_name=name, allow=cdp_filter(graph, (DP_AXIS,), base=allow))
    assert result.best is not None
    return result.best.model_dump_json()


CASES = {
    "mlp dp": ("mlp-tiny", 4, "dp", 2),
    "mlp sync": ("mlp-tiny", 4, "sync", 2),
    "mlp v1": ("mlp-tiny", 4, "v1", 2),
    "mlp v2": ("mlp-tiny", 4, "v2", 4),
    "mlp v2 N > L": ("mlp-tiny", 4, "v2", 2),  # v2 with more workers than stages
    "mlp v1 on a DP plan": ("mlp-tiny", 4, "v1", 2),  # gradient buckets compiled in: CDPTrainer takes their hooks off
    "gpt dp": ("gpt-tiny", 4, "dp", 4),
    "gpt sync": ("gpt-tiny", 4, "sync", 4),
    "gpt v1": ("gpt-tiny", 4, "v1", 4),
    "gpt v2": ("gpt-tiny", 4, "v2", 4),
    "gpt v2 dp=2 x tp=2": ("gpt-tiny", 2, "v2", 4),
    "gpt v1 dp=2 x tp=2": ("gpt-tiny", 2, "v1", 2),
    "mlp planned v1": ("mlp-tiny", 4, "plan", 2),
    "gpt planned v2": ("gpt-tiny", 4, "plan", 4),
    "mlp planned v1 zero": ("mlp-tiny", 4, "plan", 2),
    "gpt planned v2 zero": ("gpt-tiny", 4, "plan", 4),
    "gpt planned v1 zero dp=2 x tp=2": ("gpt-tiny", 2, "plan", 2),
    "mlp planned v1 zero2": ("mlp-tiny", 4, "plan", 2),
    "gpt planned v2 zero2": ("gpt-tiny", 4, "plan", 4),
    "gpt planned v1 zero2 dp=2 x tp=2": ("gpt-tiny", 2, "plan", 2),
    "mlp planned v1 zero3": ("mlp-tiny", 4, "plan", 2),
    "gpt planned v2 zero3": ("gpt-tiny", 4, "plan", 4),
    "gpt planned v1 zero3 dp=2 x tp=2": ("gpt-tiny", 2, "plan", 2),
}
PLANNED = {label: label.split()[2] for label in CASES if " planned " in label}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    plans: dict[tuple[str, int, str], str] = {}
    cases = []
    for label, (name, dp, rule, stages) in CASES.items():
        allow = data_parallel if dp == 4 else megatron_dp
        if rule == "plan":
            zero = 3 if "zero3" in label else 2 if "zero2" in label else 1 if "zero" in label else 0
            cases.append((name, _plan(name, dp, allow, PLANNED[label], stages, zero=zero), rule, stages))
            continue
        # CDP runs use a CDP plan (its rule overridden by `rule`), but for the one on a DP plan
        mode = "off" if rule == "dp" or "DP plan" in label else "v1"
        if (name, dp, mode) not in plans:
            plans[(name, dp, mode)] = _plan(name, dp, allow, mode)
        cases.append((name, plans[(name, dp, mode)], rule, stages))
    per_rank = run_world(4, cdp_train, cases, timeout=900)
    return {label: [r[i] for r in per_rank] for i, label in enumerate(CASES)}


def test_sync_chain_equals_ordinary_data_parallelism(runs) -> None:  # type: ignore[no-untyped-def]
    for model in ("mlp", "gpt"):
        dp, sync = runs[f"{model} dp"][0], runs[f"{model} sync"][0]
        assert sync["losses"] == pytest.approx(dp["losses"], rel=1e-12)
        for k, v in dp["params"].items():
            assert torch.allclose(torch.tensor(sync["params"][k]), torch.tensor(v), rtol=0, atol=1e-12 * max(1.0, torch.tensor(v).abs().max().item())), k


def test_v1_and_v2_equal_serial_loops_of_their_update_rules(runs) -> None:  # type: ignore[no-untyped-def]
    for label, ranks in runs.items():
        rep = ranks[0]
        if rep["rule"] == "dp":
            continue
        assert rep["param_error"] <= 1e-10, (label, rep["param_error"])
        assert rep["losses"] == pytest.approx(rep["ref_losses"], rel=1e-10), label


def test_the_delayed_rules_really_differ_from_dp(runs) -> None:  # type: ignore[no-untyped-def]
    """v1 and v2 are not DP in disguise: their parameters after 5 steps differ from sync's."""
    for model in ("mlp", "gpt"):
        sync = runs[f"{model} sync"][0]["params"]
        for rule in ("v1", "v2"):
            other = runs[f"{model} {rule}"][0]["params"]
            assert max((torch.tensor(other[k]) - torch.tensor(v)).abs().max().item() for k, v in sync.items()) > 1e-6, (model, rule)


def test_each_stage_sends_2_n_minus_1_messages_a_step_and_no_collective(runs) -> None:  # type: ignore[no-untyped-def]
    """Per stage per step 2(N-1) buffers sent over all ranks for each of the stage's pieces
    (planner.stages.message_units; ZeRO-3: N-1 gradients to the owner and, to each other worker, the
    piece before each forward and backward that reads it, so 3(N-1), 5(N-1) for an embedding tied to
    the last stage's head), no collective over the data-parallel axis, and nothing else sent but the
    clock's tokens (and, ZeRO-3, the fetches for the steps after the last, taken and dropped)."""
    for label, ranks in runs.items():
        if ranks[0]["rule"] == "dp":
            continue
        n, stages = ranks[0]["workers"], ranks[0]["stages"]
        tp = 4 // n  # the tensor-parallel ranks of a worker each pass their own shard
        assert ranks[0]["param_stages"], label
        for step in range(5):
            for stage in range(stages):
                sent = sum(1 for r in ranks for (t, s, _) in r["messages"] if (t, s) == (step, stage))
                pieces = ranks[0]["parts"][stage]
                readers = 1 + sum(1 for reads in ranks[0]["reads"] if stage in reads)
                per_piece = 1 + 2 * readers if ranks[0]["fetch"] else 2
                expected = per_piece * (n - 1) * tp * pieces if stage in ranks[0]["param_stages"] else 0  # no parameters, nothing to send
                assert sent == expected, (label, step, stage, sent)
        for r in ranks:
            assert r["dp_collectives"] == 0, (label, r["dp_collective_bytes"])
            # besides the stage buffers, the clock's token after each of a step's 2L ops (planner.cdp_clock)
            assert r["sends_recorded"] == len(r["messages"]) + 5 * 2 * stages, label
            if not r["fetch"]:
                assert all(t < 5 for t, _, _ in r["messages"]), label


def test_the_runtime_runs_cdps_clock(runs) -> None:  # type: ignore[no-untyped-def]
    """On 4 ranks (dp=4, L = 2 and 4, v1, v2, ZeRO-1), each rank sends exactly the stage buffers the
    clock (planner.cdp_clock) puts at each of its ops, in that order, through finish(); and no op
    starts (time.monotonic, one clock for every process here) before its predecessor's op that the
    schedule puts before it has ended: the paper's uniform delay is enforced, not left to chance."""
    from planner.cdp_clock import Clock

    for label in ("mlp v1", "mlp v2", "gpt v1", "gpt v2", "gpt planned v2", "gpt planned v2 zero", "mlp planned v1 zero", "mlp planned v1 zero2",
                  "gpt planned v2 zero2", "mlp planned v1 zero3", "gpt planned v2 zero3", "mlp v2 N > L"):
        ranks = runs[label]
        rep = ranks[0]
        workers, stages = rep["workers"], rep["stages"]
        clock = Clock(workers, stages, rep["owners"], rep["trainer_rule"], rep["has_params"], hold=rep["hold"], parts=rep["parts"], star=rep["star"],
                      fetch=rep["fetch"], reads=rep["reads"])
        end = clock.drained_by(STEPS - 1)
        if rep["fetch"]:  # finish() takes (and drops) the fetches sent for the two steps after the last
            end = max(end, 2 * stages * (STEPS + 2))

        def sent(m: Any, clock: Clock = clock) -> bool:  # runtime.cdp.CDPTrainer._runs
            if m.kind in ("fetch", "refetch"):
                return bool(m.step <= STEPS + 1 and clock.version(m.dst, m.step, m.stage) < STEPS)
            return bool(m.step < STEPS)

        planned: dict[int, list[tuple[int, tuple[Any, ...]]]] = {n: [] for n in range(workers)}
        for op in range(end):
            for n in range(workers):
                planned[n] += [(op, dataclasses.astuple(m)) for m in clock.actions(n, op).sends if sent(m)]
        ops = {}
        for r in ranks:
            assert [(op, tuple(m)) for op, m, _ in r["sent"]] == planned[r["worker"]], (label, r["worker"])
            ops[r["worker"]] = {op: (start, stop) for op, start, stop in r["ops"]}
        assert all(len(ops[n]) == 2 * stages * STEPS for n in ops), label
        for n in ops:
            for op, (start, _) in ops[n].items():
                gate = clock.gate(n, op)
                if gate in ops[(n - 1) % workers]:  # (the predecessor's ops after its last step run in finish(), unstamped)
                    assert start >= ops[(n - 1) % workers][gate][1], (label, n, op, gate)


def test_a_cdp_plan_prices_the_messages_the_busiest_rank_sends(runs) -> None:  # type: ignore[no-untyped-def]
    """Plans made with cdp=v1/v2 run with the plan's own rule and stages; the rank that sends the
    most bytes sends exactly the messages the plan priced (a piece's buffer twice a step, once
    where the rank owns the piece or is the worker before its owner). With and without ZeRO, with
    as many stages as workers or fewer, the ranks' sent bytes are within 10 % of each other
    (planner.stages.message_units: with one owner for every stage two of the four ranks sent half
    what the others did; with 2 stages on 4 workers and one piece a stage, two ranks owned nothing,
    1.32 on mlp-tiny)."""
    for label in PLANNED:
        ranks = runs[label]
        sent = [sum(nbytes * c for _, _, nbytes, c in r["sends"]) for r in ranks]
        busiest = ranks[max(range(len(ranks)), key=lambda r: (sent[r], -r))]
        assert max(sent) <= 1.10 * min(sent), (label, sent)
        if "zero" in label:
            continue
        assert busiest["sends_equal_priced"], (label, busiest["sends"], busiest["priced_sends"])


def test_cdp_with_zero_keeps_each_stages_optimizer_on_its_owner_as_predicted(runs) -> None:  # type: ignore[no-untyped-def]
    """CDP + ZeRO (each piece's optimizer state and master copy on its owner, the pieces spread so
    that every rank owns about as much: planner.stages.message_units; updated parameters travel
    back around the ring): the busiest owner holds exactly the plan's optimizer bytes, every rank
    the plan's parameter bytes, and the least within 10 % of the most."""
    for label in PLANNED:
        if "zero" not in label:
            continue
        ranks = runs[label]
        held = [r["held"] for r in ranks]
        predicted = ranks[0]["predicted"]
        # (ZeRO-3: after finish() every rank holds theta(K) whole again; between steps the versions: the test above)
        assert all(h["params"] == (ranks[0]["full_params"] if "zero3" in label else predicted["params"]) for h in held), (label, held, predicted)
        assert max(h["optimizer"] for h in held) == predicted["optimizer"], (label, held, predicted)
        assert min(h["optimizer"] for h in held) >= predicted["optimizer"] / 1.10, (label, held)


def test_cdp_holds_between_steps_the_message_buffers_its_plan_priced(runs) -> None:  # type: ignore[no-untyped-def]
    """Between two steps the busiest rank holds exactly the message buffers the plan priced beside
    the step's own gradient (the breakdown's gradients less one copy of the parameters): without
    ZeRO and with ZeRO-1 the previous step's whole buffer; with ZeRO-2 (the star; ZeRO-0 and 1 too
    under v2) the sums of the pieces a rank owns until every worker has taken them,
    counted on the clock (v1 on 4 workers: two steps' sums, half the buffer; the last worker one),
    and with ZeRO-0 the sums it received until its update. No rank holds more."""
    for label in PLANNED:
        ranks = runs[label]
        full = ranks[0]["full_params"]
        predicted = ranks[0]["predicted"]["grads"] - full  # beside the step's own gradient
        if "zero3" in label:  # the owners' versions of their pieces, the plan's parameters
            predicted += ranks[0]["predicted"]["params"]
        held = [max(r["between"][1:]) for r in ranks]
        assert max(held) == predicted, (label, [r["between"] for r in ranks], predicted)
        if "zero2" in label and ranks[0]["workers"] == 4:
            assert predicted <= full / 2, (label, predicted)


def test_the_refusal_sees_the_gathers_a_kernel_runs_on_its_inputs() -> None:
    """CDPTrainer's static check reads every layout conversion of the module: the graph's own and
    those a ``RegatherKernel`` runs on its inputs (and again in backward), one level down."""
    from types import SimpleNamespace

    from planner.layout import Step
    from planner.runtime.cdp import _collectives_over
    from planner.runtime.collectives import Convert
    from planner.runtime.kernels import RegatherKernel

    groups = SimpleNamespace(size=lambda axes: 2)
    gather = Convert((Step("all_gather", ("dp",), 0),), (Step("reduce_scatter", ("dp",), 0),), groups, None, "w: [dp,-] -> [-,-]")  # type: ignore[arg-type]
    local = Convert((Step("all_gather", ("tp",), 1),), (), groups, None, "x: [-,tp] -> [-,-]")  # type: ignore[arg-type]
    root = torch.nn.Module()
    root.linear_kernel = RegatherKernel(torch.nn.Identity(), {1: gather}, groups, None)  # type: ignore[arg-type]
    root.convert_x = local
    root.graph = SimpleNamespace(nodes=[SimpleNamespace(op="call_module", target="linear_kernel", name="linear")])
    pm = SimpleNamespace(graph_module=root, node_origin={"linear": "linear_3"}, mesh_groups=groups)
    found = _collectives_over(pm, "dp")  # type: ignore[arg-type]
    assert found == [("all_gather", "fwd", " (an input linear_3's kernel gathers: w: [dp,-] -> [-,-])"),
                     ("reduce_scatter", "bwd", " (an input linear_3's kernel gathers: w: [dp,-] -> [-,-])")], found
    assert _collectives_over(pm, "pp") == []  # type: ignore[arg-type]


def test_a_plan_with_a_collective_over_cdps_workers_is_refused_not_left_to_hang() -> None:
    """A plan made without CDP may all-reduce over the workers inside backward (GPT's position
    embedding: its gradient has no batch rows). On CDP's clock the workers reach it at different
    ops and would wait for each other for ever: CDPTrainer refuses the plan, naming the op."""
    from planner.plan import Plan

    text = _plan("gpt-tiny", 4, data_parallel)
    assert any(c.kind == "all_reduce" and c.phase == "bwd" and "dp" in c.axes for c in Plan.model_validate_json(text).comms)
    errors = run_world(4, cdp_barred, "gpt-tiny", text, timeout=300)
    assert all("collective (all_reduce) over the data-parallel axis 'dp' in bwd (converting the output of" in e and "re-plan with CDP" in e for e in errors), errors


@pytest.mark.parametrize("model, stages", [("mlp-tiny", 2), ("gpt-tiny", 4)])
def test_cdp_holds_constant_saved_bytes_equal_to_the_formula(model: str, stages: int) -> None:
    rep = run_world(4, cdp_memory, model, _plan(model, 4, data_parallel), stages, timeout=600)[0]
    a, n, big_l = rep["A"], 4, stages
    assert rep["after_release"] == 0 and all(x > 0 for x in a), rep
    formula = n / big_l * sum((big_l - stage) * a[stage] for stage in range(big_l))
    steady = rep["cdp"][(n - 1) * rep["delta"] : 2 * big_l * 3]
    assert set(steady) == {formula}, (steady, formula)
    assert max(rep["dp"]) == n * sum(a)
    assert max(rep["cdp"]) < max(rep["dp"])


def test_the_planner_prices_cdp_as_a_search_dimension() -> None:
    """gpt2-small on 8 devices, dp only: CDP's messages carry the DP gradient bytes (up to two per
    stage, on the busiest rank), priced on CDP's clock, and v1 holds one more gradient copy, v2 (the
    star) less than that (its update waits for its use, no second parameter version); with ZeRO-1 only the stages' owners keep optimizer state; with
    ZeRO-2 too, and the gradients leave for their owners (the star: no buffer held through the step, each owner's sums instead);
    with ZeRO-3 the owners keep the parameters too, each op fetching its pieces; dp = 1 is pruned with a reason; the report
    states the one-step delay."""
    from planner.report import format_plan

    model = build_model("gpt2-small", device="meta")
    args, kwargs = example_inputs("gpt2-small", batch=8, device="meta")
    graph = trace(model, args, kwargs)
    space = SearchConfig(devices=8, tp=("none", "1d"), zero=(0, 1, 2, 3), cdp=("off", "v1", "v2"), cdp_stages=8, front=False)
    result = search(graph, space, model_name="gpt2-small", exhaustive=True)
    plans = {(str(c.mesh), c.zero, c.cdp): c.plan for c in result.candidates}
    reasons = {(str(c.mesh), c.zero, c.cdp): c.reason for c in result.candidates if c.plan is None}
    assert "needs dp > 1" in reasons[("dp=1 x tp=8", 0, "v1")]
    assert ("dp=8 x tp=1", 3, "v2") not in reasons, reasons.get(("dp=8 x tp=1", 3, "v2"))
    off, v1, v2 = (plans[("dp=8 x tp=1", 0, mode)] for mode in ("off", "v1", "v2"))
    assert off is not None and v1 is not None and v2 is not None
    all_reduced = sum(c.nbytes * c.count for c in off.comms if c.kind == "all_reduce" and c.phase == "step")
    tokens = [c for c in v1.comms if c.kind == "send" and c.nbytes == TOKEN_BYTES]
    assert sum(c.count for c in tokens) == 2 * 8  # the clock's token after each of the 2L ops
    sends = [c for c in v1.comms if c.kind == "send" and c.nbytes != TOKEN_BYTES]
    # two per piece of a stage that has parameters (a stage cut into pieces where that evens the
    # ranks' bytes: planner.stages.message_units), one where the rank owns it or is the worker before its owner
    assert 8 <= sum(c.count for c in sends) <= 2 * 8 * 8
    # the busiest rank: every stage's buffer twice, but once for the pieces it or the next worker owns
    assert all_reduced < sum(c.nbytes * c.count for c in sends) < 2 * all_reduced
    assert not any(c.kind == "all_reduce" and c.phase == "step" for c in v1.comms)
    assert v1.step_time_s >= v1.compute_time_s  # its clock's step (test_cdp_is_priced_by_its_clock), no less than its compute
    assert v1.memory_breakdown.grads == 2 * off.memory_breakdown.grads
    # v2 keeps no second parameter version (its update waits) and runs as the star: each worker keeps the sums it received
    # until its update and each owner its own until every worker has taken them, less than v1's whole extra buffer on the
    # clock here (the runtime holds what the clock counts: test_cdp_holds_between_steps_the_message_buffers_its_plan_priced)
    assert v2.memory_breakdown.params == off.memory_breakdown.params
    assert off.memory_breakdown.grads < v2.memory_breakdown.grads < 2 * off.memory_breakdown.grads
    zero = plans[("dp=8 x tp=1", 1, "v1")]
    # owners only: each rank owns about 1/8 of the states (stage 0, embedding + tied LM head, is cut into pieces)
    assert zero is not None and zero.memory_breakdown.optimizer < off.memory_breakdown.optimizer
    zero2 = plans[("dp=8 x tp=1", 2, "v1")]
    assert zero2 is not None and zero2.memory_breakdown.optimizer == pytest.approx(zero.memory_breakdown.optimizer, rel=0.02)
    # the step's own gradient, and the sums this rank owns until every worker has taken them (about 2/N of the buffer,
    # counted on the clock: test_cdp_holds_between_steps_the_message_buffers_its_plan_priced), where ZeRO-1 holds the
    # previous step's whole buffer
    assert off.memory_breakdown.grads * (1 + 1 / 8) < zero2.memory_breakdown.grads < off.memory_breakdown.grads * (1 + 3 / 8)
    star = [c for c in zero2.comms if c.kind == "send" and c.nbytes != TOKEN_BYTES]
    assert sum(c.nbytes * c.count for c in star) == pytest.approx(2 * 7 / 8 * all_reduced, rel=0.10)  # each piece to its owner, owned ones to 7
    # ZeRO-3: no whole parameters between ops, an owner's pieces in the versions in use instead (about 3/N here); each op
    # fetches its pieces (twice a step, four times for the embedding the last stage's LM head reads): more bytes than ZeRO-2's
    zero3 = plans[("dp=8 x tp=1", 3, "v1")]
    assert zero3 is not None and zero3.memory_breakdown.params < off.memory_breakdown.params / 2
    fetched = [c for c in zero3.comms if c.kind == "send" and c.nbytes != TOKEN_BYTES]
    assert sum(c.nbytes * c.count for c in fetched) > 1.5 * sum(c.nbytes * c.count for c in star)
    assert zero3.peak_memory_bytes < zero2.peak_memory_bytes
    text = format_plan(v1)
    assert "one-step gradient delay" in text and "CDPTrainer" in text


def _one_device_plan(name: str, micro_batch: int = BATCH // 4) -> str:
    model = build_model(name, dtype=torch.float64)
    args, kwargs = example_inputs(name, batch=micro_batch, dtype=torch.float64)
    result = search(trace(model, args, kwargs), SearchConfig(devices=1, tp=("none",), optimizer="sgd-momentum", front=False), model_name=name)
    assert result.best is not None
    return result.best.model_dump_json()


PIPELINES = {  # label: (model, rule, N workers, L stages, global batch, built on meta)
    "mlp v1": ("mlp-tiny", "v1", 4, 2, BATCH, False), "mlp v2": ("mlp-tiny", "v2", 4, 2, BATCH, False),
    "vit v1": ("vit-tiny", "v1", 4, 2, BATCH, False), "vit v2": ("vit-tiny", "v2", 4, 2, BATCH, False),
    "mlp v2 L=4": ("mlp-tiny", "v2", 4, 4, BATCH, False),
    "vit v2 from meta": ("vit-tiny", "v2", 4, 2, BATCH, True), "mlp v1 L=4 from meta": ("mlp-tiny", "v1", 4, 4, BATCH, True),
    "mlp v2 N=2 L=4": ("mlp-tiny", "v2", 2, 4, BATCH, False),  # L does not divide N: D = 1 device per stage, 2 workers each
    "vit v1 N=3 L=2": ("vit-tiny", "v1", 3, 2, 6, True),  # D = 2: one column serves workers 0 and 2, the other worker 1
}


@pytest.fixture(scope="module")
def pipelines() -> dict[str, list[dict[str, Any]]]:
    cases = [(name, _one_device_plan(name, batch // n), rule, n, stages, batch, meta) for name, rule, n, stages, batch, meta in PIPELINES.values()]
    ranks = run_world(4, cdp_pipeline, cases, timeout=900)
    return {label: [r[i] for r in ranks] for i, label in enumerate(PIPELINES)}


def test_cdp_with_model_parallelism_equals_the_serial_update_rules(pipelines) -> None:  # type: ignore[no-untyped-def]
    """N micro-batches on L * ceil(N/L) = 4 ranks: N = 4 with L = 2 (each stage on D = 2 devices,
    each device serving 2 workers in alternating forward and backward slots) and L = 4 (D = 1), and
    N = 2 with L = 4, N = 3 with L = 2, where L does not divide N: losses and parameters after 5
    steps equal the serial loops of v1 and v2 (1e-10), and each stage's gradient is summed over its
    D devices with 2(D-1) messages per step."""
    for label, ranks in pipelines.items():
        rep = ranks[0]
        assert rep["covered"], label
        assert rep["param_error"] <= 1e-10, (label, rep["param_error"])
        assert rep["losses"] == pytest.approx(rep["ref_losses"], rel=1e-10), label
        workers, stages = PIPELINES[label][2], PIPELINES[label][3]
        per_stage = -(-workers // stages)  # D
        assert len({r["stage"] for r in ranks}) == stages and per_stage * stages == 4, label
        for step in range(5):
            for stage in range(stages):
                sums = sum(1 for r in ranks if r["stage"] == stage for (k, kind) in r["messages"] if k == step and kind in ("chain", "ring"))
                assert sums == 2 * (per_stage - 1), (label, step, stage, sums)


def test_cdp_with_model_parallelism_from_meta_materialises_only_each_ranks_stage(pipelines) -> None:  # type: ignore[no-untyped-def]
    """Built from a model on the meta device (CDPPipeline.build), a rank's module holds off the
    meta device exactly its stage's parameter elements, and the stages' together are the model's;
    the values are the CPU build's (the rule test above compares them with the twin's run)."""
    for label, ranks in pipelines.items():
        if not ranks[0]["meta"]:
            continue
        total = ranks[0]["total_elements"]
        for r in ranks:
            assert r["held"] == r["stage_elements"] < total, (label, r["stage"], r["held"], r["stage_elements"], total)
        per_stage = {r["stage"]: r["stage_elements"] for r in ranks}
        assert sum(per_stage.values()) == total, (label, per_stage, total)


def test_cdp_with_model_parallelism_refuses_a_weight_tied_across_stages() -> None:
    """gpt-tiny ties its LM head to the token embedding: stage 0 and the last stage both read it."""
    with pytest.raises(RuntimeError, match="read by stages \\[0, 1\\] \\(a tied weight\\?\\)"):
        run_world(4, cdp_pipeline, [("gpt-tiny", _one_device_plan("gpt-tiny"), "v1", 4, 2, BATCH, False)], timeout=300)


def test_in_flight_counts_a_devices_micro_batches_between_forward_and_backward() -> None:
    """planner.stages.in_flight: L - l where L divides N (a device's workers 2 time units apart);
    where it does not, the count from the clock (N = 2, L = 4: one device per stage, its 2 workers
    4 units apart; N = 3, L = 2: workers 0 and 2 share a device, 8/3 units apart)."""
    from planner.stages import counted_in_flight, in_flight

    for workers, stages in ((4, 2), (4, 4), (8, 4), (16, 4)):
        assert [in_flight(workers, stages, st) for st in range(stages)] == [stages - st for st in range(stages)]
    for workers in range(1, 41):  # the clock's count is the closed form wherever L divides N
        for stages in (1, 2, 3, 4, 5, 8):
            if workers % stages == 0:
                assert [counted_in_flight(workers, stages, st) for st in range(stages)] == [stages - st for st in range(stages)]
    assert [in_flight(2, 4, st) for st in range(4)] == [2, 2, 1, 1]
    assert [in_flight(3, 2, st) for st in range(2)] == [2, 2]
    assert [in_flight(4, 1, 0)] == [1]


def test_the_pipeline_estimate_follows_the_cdp_memory_formula() -> None:
    """planner.schemes.cdp.pipeline_estimate: L * N/L devices for N workers (DP x MP needs N * L); a device of
    stage l holds (L - l) micro-batches of A_l, which summed over the D devices of every stage is
    (N/L) sum_l (L - l) A_l; the report lists it when CDP is searched."""
    from planner.schemes.cdp import pipeline_estimate
    from planner.stages import cut_stages

    model = build_model("gpt2-small", device="meta")
    args, kwargs = example_inputs("gpt2-small", batch=16, device="meta")
    graph = trace(model, args, kwargs)
    n, big_l = 16, 4
    est = pipeline_estimate(graph, A100_80G, workers=n, stages=big_l)
    assert (est.devices, est.dp_mp_devices, est.per_stage) == (16, 64, 4)
    a_micro = [a / n for a in cut_stages(graph, big_l).saved_bytes]
    assert list(est.stage_activations) == pytest.approx([(big_l - stage) * a_micro[stage] for stage in range(big_l)])
    total = sum(est.per_stage * x for x in est.stage_activations)
    assert total == pytest.approx(n / big_l * sum((big_l - stage) * a_micro[stage] for stage in range(big_l)))
    assert total < n * sum(a_micro)  # DP holds every micro-batch's activations of every stage at its peak
    result = search(graph, SearchConfig(devices=16, tp=("none",), cdp=("v1",), front=False), model_name="gpt2-small")
    assert [e.stages for e in result.pipelines] == [2, 4, 8]


def test_cdp_is_priced_by_its_clock() -> None:
    """planner.schemes.cdp.cdp_overlap, on gpt-tiny over dp=4, 4 stages, v1 and v2, ZeRO 0 and 1:
    the busiest rank sends its units' buffers (v1's chain and ring: twice a unit, once where it
    owns it or is the worker before its owner; v2's star: once, N-1 times where it owns it) and the
    2L tokens; the price is CDP's clock run timed (each stage op its share of the worker's busy
    seconds, each message its alpha-beta time): with overlap efficiency 1 the priced step is the
    clock's settled step, with 0.5 half of what the clock hides is credited."""
    from planner.cdp_clock import ring_hold, schedule_units, star_messages
    from planner.cost import comm_time
    from planner.mesh import Mesh
    from planner.problem import build_problem
    from planner.schemes.cdp import cdp_traffic, stage_itemsize, stage_message_bytes, step_period
    from planner.solve import solve
    from planner.stages import cut_stages
    from planner.strategy import Comm

    graph = trace(build_model("gpt-tiny", device="meta"), *example_inputs("gpt-tiny", batch=8, device="meta"))
    mesh = Mesh(("dp", "tp"), (4, 1))
    shares = [f / sum(cut_stages(graph, 4).flops) for f in cut_stages(graph, 4).flops]
    for eta in (1.0, 0.5):
        hw = A100_80G.model_copy(update={"overlap_efficiency": eta})
        for zero in (0, 1):
            for rule in ("v1", "v2"):
                star = star_messages(rule, zero)
                problem = build_problem(graph, mesh, hw, cdp=rule, cdp_stages=4, zero_stage=zero)
                solution = solve(problem, memory_budget=float("inf"))
                e = solution.evaluation
                sizes = stage_message_bytes(problem, solution.assignment)
                units = schedule_units(sizes, 4, rule, zero == 1, stage_itemsize(problem), star=star)
                owners, rank = units.owners, cdp_traffic(problem, solution.assignment).rank
                sends = [(c, n) for c, n in e.comms if c.kind == "send" and c.nbytes != TOKEN_BYTES]
                per_unit = [(3 if rank == o else 1) if star else (1 if rank in (o, (o - 1) % 4) else 2) for o, b in zip(owners, units.sizes, strict=True) if b]
                assert sum(n for _, n in sends) == sum(per_unit)
                assert sum(n for c, n in e.comms if c.kind == "send" and c.nbytes == TOKEN_BYTES) == 2 * 4
                p2p = sum(comm_time(c, mesh, hw) * n for c, n in e.comms if c.kind == "send")
                busy = e.compute_time + sum(comm_time(c, mesh, hw) * n for c, n in e.comms if c.kind != "send")
                durations = [busy * f / 3 for f in shares] + [busy * f * 2 / 3 for f in reversed(shares)]
                seconds = {b: comm_time(Comm("send", ("dp",), b, "bwd"), mesh, hw) for b in {*units.sizes, TOKEN_BYTES}}
                has = [b > 0 for b in sizes]
                period = step_period(4, 4, owners, rule, has, durations,
                                     lambda m, seconds=seconds, units=units: seconds[TOKEN_BYTES if m.kind == "token" else units.sizes[units.unit(m.stage, m.part)]],
                                     hold=ring_hold(4, 4, owners, rule, has, units.parts, star=star), parts=units.parts, star=star)
                waits = max(0.0, period - busy - p2p)
                assert e.step_time == pytest.approx(busy + p2p + waits - eta * (busy + p2p + waits - period), rel=1e-6), (eta, zero, rule)
                assert busy <= e.step_time <= busy + p2p + waits + 1e-12


def test_cdp_stage_owners_even_the_ranks_sends_or_their_optimizer_state() -> None:
    """planner.stages.stage_owners: one owner for every stage made two of four ranks send half what
    the others did; the owners it picks send the same on stages of equal size and within 11 % on
    these unequal ones (the best split of [130, 130, 130, 60] over 4 ranks is 640/710); with ZeRO
    the owned bytes are evened instead (largest first)."""
    from planner.stages import stage_owners

    def sent(sizes: list[int], owners: tuple[int, ...], n: int) -> list[int]:
        return [sum(b * (1 if r in (o, (o - 1) % n) else 2) for o, b in zip(owners, sizes, strict=True)) for r in range(n)]

    for sizes, n, bound in (([100] * 4, 4, 1.0), ([100] * 8, 4, 1.0), ([100] * 4, 8, 1.0), ([130, 130, 130, 60], 4, 1.11),
                            ([16, 64, 64, 80], 4, 1.11), ([209, 59, 63, 54, 43, 47, 0, 0], 4, 1.05), ([100, 50], 2, 1.0)):
        got = sent(sizes, stage_owners(sizes, n, zero=False), n)
        assert max(got) / min(got) <= bound, (sizes, n, got)
        one_owner = sent(sizes, (n - 1,) * len(sizes), n)
        assert max(got) <= max(one_owner)
    assert stage_owners([80, 64, 64, 16], 4, zero=True) == (0, 1, 2, 3)
    assert stage_owners([10, 10, 10, 10, 10, 10, 10, 10], 4, zero=True) == (0, 1, 2, 3, 0, 1, 2, 3)
    held = [0] * 3
    for s, o in enumerate(stage_owners([50, 40, 30, 20, 10], 3, zero=True)):
        held[o] += [50, 40, 30, 20, 10][s]
    assert max(held) == 50


def test_cdp_pieces_even_the_ranks_bytes_and_optimizer_state_with_few_pieces() -> None:
    """planner.stages.message_units: on 300 random stage layouts (2 to 8 stages, 2 to 8 workers,
    sizes over two orders of magnitude, some stages without parameters) every rank sends within
    10 % of the least, and with ZeRO owns within 10 % of the least; pieces are whole values, a
    piece's bytes add up to its stage's, and where whole stages already balance they stay whole."""
    import random

    from planner.stages import BALANCE, message_units, owned_bytes, piece_bounds, sent_bytes, stage_owners

    rng = random.Random(0)
    for _ in range(300):
        stages, workers = rng.randint(2, 8), rng.randint(2, 8)
        sizes = [rng.choice([0, *([4 * rng.randint(100, 10_000)] * 4)]) for _ in range(stages)]
        if not any(sizes):
            continue
        for zero in (False, True):
            units = message_units(sizes, workers, zero=zero, itemsize=[4] * stages)
            assert max(sent_bytes(units.sizes, units.owners, workers)) <= BALANCE * min(sent_bytes(units.sizes, units.owners, workers)), (sizes, workers, zero)
            if zero:
                held = owned_bytes(units.sizes, units.owners, workers)
                assert max(held) <= BALANCE * min(held), (sizes, workers, held)
            for stage, b in enumerate(sizes):
                mine = [units.sizes[u] for u in units.of_stage(stage)]
                assert sum(mine) == b and all(m % 4 == 0 for m in mine), (sizes, units)
                assert [(hi - lo) * 4 for lo, hi in piece_bounds(b // 4, units.parts[stage])] == mine
            whole = stage_owners(sizes, workers, zero=zero)
            if not zero and max(sent_bytes(sizes, whole, workers)) <= BALANCE * min(sent_bytes(sizes, whole, workers)):
                assert units.parts == (1,) * stages, (sizes, workers, units.parts)


def test_nothing_fits_advises_cdp_only_where_its_stages_on_devices_would_hold_less() -> None:
    """The advice quotes the pipeline estimate (stages on different devices) and only where it needs
    less than the least memory any plan needs; CDP over data parallelism alone holds more per
    device than DP, so it is never advised for memory."""
    from planner.messages import nothing_fits
    from planner.schemes.cdp import pipeline_estimate
    from planner.space import candidate_meshes
    from planner.units import format_bytes

    graph = trace(build_model("gpt-tiny", device="meta"), *example_inputs("gpt-tiny", batch=8, device="meta"))
    space = SearchConfig(devices=4, memory_budget=1.0)
    est = pipeline_estimate(graph, A100_80G, workers=4, stages=2)
    cand = candidate_meshes(space, 8)[0]
    memory = {"params": 1.0, "grads": 1.0, "optimizer": 2.0, "activations": 10.0, "transient": 0.0}
    above = nothing_fits(space, graph, 2 * est.peak_memory, cand, memory, est)
    assert "CDP with its 2 stages on different devices" in above and format_bytes(est.peak_memory) in above
    below = nothing_fits(space, graph, est.peak_memory / 2, cand, memory, est)
    assert "CDP" not in below
    assert "CDP" not in nothing_fits(space, graph, 2 * est.peak_memory, cand, memory, None)


def test_an_assignment_breaks_cdps_rule_exactly_where_the_ilp_forbids_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """CDP bars collectives over its workers' axes: the ILP holds those strategies and pairs of
    Specs at 0, and :func:`planner.problem.breaks_a_rule` says the same of every assignment (so
    an LP relaxation's rounded answer that breaks it never stands for a plan). Brute force over
    all 31,104 assignments of a two-linear model on dp=2 x tp=2, CDP v1, most of which break it;
    an LP relaxation whose answer rounds to one that breaks it gives no plan."""
    from planner.ilp import Model
    from planner.problem import breaks_a_rule, build_problem
    from planner.solve import BudgetILP, SolverSettings
    from tests.test_solver import _graph

    graph = _graph("two-linear")
    mesh = Mesh(("dp", "tp"), (2, 2))
    problem = build_problem(graph, mesh, A100_80G, cdp="v1", cdp_stages=2)
    model = Model(problem, "rules")
    barred_x = {(g, i) for g, xs in model.x.items() for i, col in enumerate(xs) if model.lp.upper[col] == 0.0}
    edges = list(problem.edges.values())
    keys = list(problem.groups)
    broken = 0
    for combo in itertools.product(*(range(len(problem.groups[k].strategies)) for k in keys)):
        a = dict(zip(keys, combo, strict=True))
        barred = any((g, i) in barred_x for g, i in a.items())
        for edge, e in zip(edges, model.e_of, strict=True):
            src = next((s for s, idx in edge.src_sets.items() if a[edge.group_u] in idx), None)
            dst = next((d for d, idx in edge.dst_sets.items() if a[edge.group_v] in idx), None)
            if src is not None and dst is not None and model.lp.upper[e[(src, dst)]] == 0.0:
                barred = True
        assert breaks_a_rule(problem, a) == barred, a
        broken += barred
    assert 0 < broken < 31104
    # a relaxation whose answer rounds to such an assignment gives no plan (and one that keeps it does)
    for breaks in (True, False):
        a = next(dict(zip(keys, c, strict=True)) for c in itertools.product(*(range(len(problem.groups[k].strategies)) for k in keys))
                 if breaks_a_rule(problem, dict(zip(keys, c, strict=True))) == breaks)
        for objective in ("time", "memory"):
            ilp = BudgetILP(problem, objective, SolverSettings())  # type: ignore[arg-type]
            monkeypatch.setattr(ilp.model, "assignment", lambda values, a=a: a)
            rounded = (ilp.relax(float("inf")) if objective == "time" else ilp.memory_relaxation()).plan
            assert (rounded is None) == breaks, (objective, breaks)
