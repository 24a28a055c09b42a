"""CDP's per-rank traffic and ZeRO optimizer state, one piece a stage against the pieces the runtime cuts.

    python benchmarks/cdp_balance.py

For each model, stage count L, worker count N and ZeRO stage (0, 1, and 2 and 3, whose messages go
straight to and from each piece's owner: planner.cdp_clock's star, which v2 uses with every ZeRO
stage: planner.cdp_clock.star_messages; with ZeRO-3 each forward and
backward that reads a piece fetches it, a tied embedding's for the head's ops too): each stage's gradient buffer
(its parameters' bytes, :func:`planner.stages.parameter_stages`), then the ranks' sent bytes a
step and, with ZeRO, their owned bytes (optimizer state and master copy), as max/min over the
ranks, with the owners whole stages get (:func:`planner.stages.stage_owners`) and with the pieces
and owners ``CDPTrainer`` uses (:func:`planner.cdp_clock.schedule_units`), and the messages a step
that costs; under rule v1, and under v2 where its pieces or its messages differ from v1's (v2
keeps a cut only where its schedule holds with it). "inf": some rank owns nothing. Printed as a GitHub markdown table.
"""

from __future__ import annotations

from planner.cdp_clock import schedule_units, star_messages
from planner.models import build_model, example_inputs
from planner.stages import cut_stages, owned_bytes, parameter_stages, sent_bytes, stage_owners
from planner.trace import trace


def _spread(values: list[int]) -> str:
    return f"{max(values) / min(values):.2f}" if min(values) > 0 else "inf"


def main() -> None:
    print("| model | L | N | ZeRO | rule | sent bytes, whole stages | pieces | ZeRO state, whole stages | pieces | pieces a stage | messages a step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("mlp-tiny", "gpt-tiny", "gpt2-small"):
        graph = trace(build_model(name, device="meta"), *example_inputs(name, batch=8, device="meta"))
        ops = sum(1 for n in graph.nodes.values() if n.kind == "op")
        for stages in (2, 4, 8):
            if stages > ops:
                continue
            of = parameter_stages(graph, stages)
            stage_of, consumers = cut_stages(graph, stages).stage_of(), graph.consumers()
            readers = [{st} for st in range(stages)]  # the stages whose ops read each stage's parameters
            reads: list[set[int]] = [set() for _ in range(stages)]
            for p in graph.params:
                for c, _ in consumers[p.name]:
                    if c in stage_of:
                        readers[of[p.name]].add(stage_of[c])
                        if stage_of[c] != of[p.name]:
                            reads[stage_of[c]].add(of[p.name])
            sizes, itemsize = [0] * stages, [1] * stages
            for p in graph.params:
                sizes[of[p.name]] += p.out.nbytes
                itemsize[of[p.name]] = max(itemsize[of[p.name]], p.out.itemsize)
            for workers in (4, 8):
                for zero in (0, 1, 2, 3):
                    fetch = zero == 3
                    frozen = tuple(tuple(sorted(r)) for r in reads) if fetch else None
                    stars = {rule: star_messages(rule, zero) for rule in ("v1", "v2")}
                    cuts = {rule: schedule_units(sizes, workers, rule, zero > 0, itemsize, star=star, fetch=fetch, reads=frozen)
                            for rule, star in stars.items()}
                    for rule, units in cuts.items():
                        if rule == "v2" and units == cuts["v1"] and stars["v2"] == stars["v1"]:
                            continue
                        star = stars[rule]
                        whole = stage_owners(sizes, workers, zero=zero > 0 or star)
                        state = ([_spread(owned_bytes(sizes, whole, workers)), _spread(owned_bytes(units.sizes, units.owners, workers))]
                                 if zero else ["-", "-"])
                        per_piece = [1 + 2 * len(readers[st]) if fetch else 2 for st in range(stages)]
                        messages = (workers - 1) * sum(p * k for p, k, b in zip(units.parts, per_piece, sizes, strict=True) if b)
                        whole_uses = [2 * len(readers[st]) for st in range(stages)] if fetch else None
                        uses = [2 * len(readers[st]) for st, p in enumerate(units.parts) for _ in range(p)] if fetch else None
                        row = [name, str(stages), str(workers), str(zero), rule, _spread(sent_bytes(sizes, whole, workers, star=star, uses=whole_uses)),
                               _spread(sent_bytes(units.sizes, units.owners, workers, star=star, uses=uses)), *state, str(max(units.parts)),
                               str(messages)]
                        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
