"""The traces the Hugging Face sharded worlds' ranks compile, made once in the fork server.

Imported by the fork server only (:data:`tests.harness.PRELOAD`), and only does anything when
:data:`ENV` is set, which tests/conftest.py does when tests/test_hf_sharded.py is collected: each
of that test's ranks and planning processes, forked from the server, then finds every model's trace
in :func:`tests.dist_checks.traced`'s cache instead of exporting it again (each rank traced every
model in float64, float32 and at CDP's batch: about 25 s of CPU a rank here, 4 or 8 ranks on 2 cores;
measured, the memory checks of 15 plans of three models on 4 ranks took 18-25 s a rank where they took
31-38 s, interleaved; the 8-rank world's set-up 116-130 s where it took 256 s).
A model whose trace fails here is traced by the ranks as before, and fails there, where the test sees it.
"""

from __future__ import annotations

import os

import torch

ENV = "PLANNER_TEST_PRELOAD_HF_TRACES"
# the models of tests/test_hf_sharded.py's worlds: Hugging Face's, and ours made of the multi-output and
# routing ops (split, chunk, unbind, split_with_sizes, topk, sort, max.dim, var_mean, gather, scatter:
# tests/ops_models.py)
MODELS = ("hf-gpt2", "hf-llama", "hf-qwen2", "hf-mistral", "hf-bert", "hf-vit", "hf-bart", "hf-mixtral")
OPS_MODEL = "tests.ops_models:ROUTED"


def preload() -> None:
    """Trace what the worlds' checks trace (tests.dist_checks' batches in float64 and float32; CDP's,
    tests.cdp_checks', in float64), into the cache they read."""
    from planner.models import example_inputs
    from tests.cdp_checks import BATCH as CDP_BATCH
    from tests.dist_checks import BATCH, build, inputs, traced

    torch.set_num_threads(1)  # as the ranks: no thread pool started before they fork from here
    for name in (*MODELS, OPS_MODEL):
        for dtype in (torch.float64, torch.float32):
            try:
                model = build(name, dtype)
                traced(name, model, *inputs(name, BATCH, dtype))
                if dtype == torch.float64 and name in MODELS:
                    traced(name, model, *example_inputs(name, batch=CDP_BATCH, dtype=dtype))
            except Exception:  # (the ranks trace it again and report the error)
                continue


if os.environ.get(ENV):
    preload()
