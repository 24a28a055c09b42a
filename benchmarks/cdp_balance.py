"""CDP's per-rank traffic and ZeRO-1 optimizer state, one piece a stage against the pieces the runtime cuts.

    python benchmarks/cdp_balance.py

For each model, stage count L and worker count N: each stage's gradient buffer (its parameters'
bytes, :func:`planner.stages.parameter_stages`), then the ranks' sent bytes a step and, with
ZeRO-1, their owned bytes (optimizer state and master copy), as max/min over the ranks, with the
owners whole stages get (:func:`planner.stages.stage_owners`) and with the pieces and owners
``CDPTrainer`` uses (:func:`planner.cdp_clock.schedule_units`, rule v1), and the messages a step
that costs. "inf": some rank owns nothing. Printed as a GitHub markdown table.
"""

from __future__ import annotations

from planner.cdp_clock import schedule_units
from planner.models import build_model, example_inputs
from planner.stages import owned_bytes, parameter_stages, sent_bytes, stage_owners
from planner.trace import trace


def _spread(values: list[int]) -> str:
    return f"{max(values) / min(values):.2f}" if min(values) > 0 else "inf"


def main() -> None:
    print("| model | L | N | ZeRO | sent bytes, whole stages | pieces | ZeRO-1 state, whole stages | pieces | pieces a stage | messages a step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("mlp-tiny", "gpt-tiny", "gpt2-small"):
        graph = trace(build_model(name, device="meta"), *example_inputs(name, batch=8, device="meta"))
        ops = sum(1 for n in graph.nodes.values() if n.kind == "op")
        for stages in (2, 4, 8):
            if stages > ops:
                continue
            of = parameter_stages(graph, stages)
            sizes, itemsize = [0] * stages, [1] * stages
            for p in graph.params:
                sizes[of[p.name]] += p.out.nbytes
                itemsize[of[p.name]] = max(itemsize[of[p.name]], p.out.itemsize)
            for workers in (4, 8):
                for zero in (False, True):
                    whole = stage_owners(sizes, workers, zero=zero)
                    units = schedule_units(sizes, workers, "v1", zero, itemsize)
                    state = ([_spread(owned_bytes(sizes, whole, workers)), _spread(owned_bytes(units.sizes, units.owners, workers))]
                             if zero else ["-", "-"])
                    messages = 2 * (workers - 1) * sum(p for p, b in zip(units.parts, sizes, strict=True) if b)
                    row = [name, str(stages), str(workers), "1" if zero else "0", _spread(sent_bytes(sizes, whole, workers)),
                           _spread(sent_bytes(units.sizes, units.owners, workers)), *state, str(max(units.parts)), str(messages)]
                    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
