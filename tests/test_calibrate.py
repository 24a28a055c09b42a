"""The cost model's measurements: calibration, the alpha-beta fit, live-tensor accounting."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from planner.hardware import PRESETS, fit_alpha_beta, load_profile
from planner.runtime.memory import LiveMemory


def test_the_alpha_beta_fit_recovers_latency_and_bandwidth() -> None:
    """Timings made from t = steps * alpha + volume * S / b with alpha = 50 us, b = 2 GB/s."""
    alpha, b, n = 50e-6, 2e9, 4
    rows = []
    for size in (2**12, 2**16, 2**20, 2**24):
        rows.append(("all_reduce", size, 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / b))
        rows.append(("all_gather", size * n, (n - 1) * alpha + (n - 1) / n * size * n / b))
    fit_a, fit_b = fit_alpha_beta(rows, n)
    assert fit_a == pytest.approx(alpha, rel=1e-6) and fit_b == pytest.approx(b, rel=1e-6)


def test_live_memory_counts_parameters_and_adamw_states() -> None:
    model = torch.nn.Linear(256, 128)
    opt = torch.optim.AdamW(model.parameters())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    mem = LiveMemory()
    with mem:
        mem.track(list(model.parameters()))
        assert mem.current == param_bytes
        model(torch.randn(32, 256)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    states = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    assert states == 2 * param_bytes
    assert mem.current >= param_bytes + states and mem.peak >= mem.current + param_bytes  # the gradients existed


def test_every_preset_cites_its_sources_and_small_ops_pay_the_launch_overhead() -> None:
    from planner.cost import compute_time
    from planner.mesh import Mesh
    from planner.models import build_model, example_inputs
    from planner.problem import build_problem
    from planner.trace import trace

    for hw in PRESETS.values():
        assert hw.sources and hw.op_overhead > 0, hw.name
    graph = trace(build_model("mlp-tiny"), *example_inputs("mlp-tiny", batch=4))
    problem = build_problem(graph, Mesh(("dp", "tp"), (1, 1)), PRESETS["a100-80g"])
    node = next(n for n in graph.nodes.values() if n.kind == "op")
    s = problem.choices[node.name][0]
    assert compute_time(node, s, problem.mesh, PRESETS["a100-80g"], 0) >= 3 * PRESETS["a100-80g"].op_overhead


def test_planner_calibrate_quick_writes_a_profile_the_report_uses(tmp_path: Path) -> None:
    from planner.cli import main

    out = tmp_path / "cpu.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["calibrate", "--out", str(out), "--quick", "--world", "2"]) == 0
    profile = load_profile(str(out))
    data = json.loads(out.read_text())
    assert profile.peak_flops["torch.float32"] > 1e8 and profile.memory_bandwidth > 1e8
    assert profile.intra_node.bandwidth > 0 and profile.op_overhead > 0
    assert "measured by planner calibrate --quick" in data["sources"]["peak_flops"]
    assert set(profile.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert all(f.bandwidth > 0 and len(f.scale) == 3 for f in profile.collectives.values())  # --quick: 3 sizes
    assert set(profile.optimizer_steps) == {"adamw", "sgd-momentum"}
    assert all(a >= 0 and c >= 0 and a + c > 0 for a, c in profile.optimizer_steps.values())
    assert 0.0 <= profile.overlap_efficiency <= 1.0 and "1024 KiB" in data["sources"]["overlap_efficiency"]  # --quick: 1 MiB
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["report", "gpt-tiny", "--devices", "2", "--tp", "none", "--zero", "0", "--hardware", str(out)]) == 0
    assert "hardware calibrated-cpu" in text.getvalue()


def test_calibrated_efficiency_curve_slows_small_shards_and_holds_flat_past_its_ends() -> None:
    from planner.hardware import CPU_GLOO
    from planner.runtime.calibrate import matmul_efficiency

    # 10 us launch cost: a 64^3 matmul measured at 20 GFLOP/s ran 26.2 us, 16.2 us of it compute
    points = matmul_efficiency([(64, 20e9), (512, 50e9)], peak=50e9, overhead=10e-6)
    assert points[0][0] == 2 * 64**3 and points[0][1] == pytest.approx(2 * 64**3 / (2 * 64**3 / 20e9 - 10e-6) / 50e9)
    assert points[1] == (2 * 512**3, 1.0)
    hw = CPU_GLOO.model_copy(update={"matmul_efficiency": {"torch.float32": points}})
    small, large = points[0][0], points[1][0]
    assert hw.efficiency("torch.float32", small / 10) == points[0][1]  # flat below the smallest size
    assert hw.efficiency("torch.float32", large * 10) == 1.0
    mid = hw.efficiency("torch.float32", (small * large) ** 0.5)  # half-way in log FLOPs
    assert mid == pytest.approx((points[0][1] + 1.0) / 2)
    assert CPU_GLOO.efficiency("torch.float32", small) == CPU_GLOO.compute_efficiency  # no curve: the constant


def test_a_collective_kinds_fit_prices_its_measured_times_and_groups_across_nodes_keep_the_tier() -> None:
    """Timings that no one alpha-beta fits (a 64 MiB message at a third of the bandwidth): the
    kind's fit and its measured / fitted ratios price every measured size at its measured time,
    sizes between on the interpolated ratio; a group spanning nodes pays the inter-node tier."""
    from planner.cost import comm_time
    from planner.hardware import CPU_GLOO
    from planner.mesh import Mesh
    from planner.runtime.calibrate import fit_collective
    from planner.strategy import Comm

    n, alpha, b = 4, 700e-6, 1e9
    sizes = [2**12, 2**16, 2**20, 2**24, 2**26]
    rows = [("all_gather", s, (n - 1) * alpha + (n - 1) / n * s / b * (3.0 if s == 2**26 else 1.0)) for s in sizes]
    fit = fit_collective(rows, n)
    hw = CPU_GLOO.model_copy(update={"collectives": {"all_gather": fit}, "devices_per_node": 4})
    mesh = Mesh(("dp",), (4,))
    for _, size, seconds in rows:
        assert comm_time(Comm("all_gather", ("dp",), size, "fwd"), mesh, hw) == pytest.approx(seconds, rel=1e-9)
    between = comm_time(Comm("all_gather", ("dp",), 2**25, "fwd"), mesh, hw)
    assert rows[3][2] * 2 < between < rows[4][2]
    # another kind keeps the tier's fit; a group across two nodes of 2 pays the inter-node tier
    assert comm_time(Comm("all_reduce", ("dp",), 2**20, "bwd"), mesh, hw) == comm_time(Comm("all_reduce", ("dp",), 2**20, "bwd"), mesh, CPU_GLOO)
    two_nodes = hw.model_copy(update={"devices_per_node": 2})
    assert comm_time(Comm("all_gather", ("dp",), 2**20, "fwd"), mesh, two_nodes) == comm_time(
        Comm("all_gather", ("dp",), 2**20, "fwd"), mesh, CPU_GLOO.model_copy(update={"devices_per_node": 2}))


def test_a_measured_optimizer_step_replaces_the_bandwidth_estimate() -> None:
    from planner.cost import optimizer_step_time
    from planner.hardware import CPU_GLOO
    from planner.runtime.calibrate import measure_optimizer_steps

    hw = CPU_GLOO.model_copy(update={"optimizer_steps": {"adamw": (30e-6, 2e-9)}})
    assert optimizer_step_time("adamw", 1e6, hw) == pytest.approx(30e-6 + 2e-3)
    assert optimizer_step_time("sgd-momentum", 1e6, hw) == optimizer_step_time("sgd-momentum", 1e6, CPU_GLOO)  # not measured: the estimate
    assert optimizer_step_time("adamw", 0, hw) == 0.0
    measured = measure_optimizer_steps(torch.device("cpu"), 0.02, large=2**16)
    assert set(measured) == {"adamw", "sgd-momentum"} and all(a >= 0 and c >= 0 and a + c > 0 for a, c in measured.values())


def test_a_thin_matmul_is_priced_below_a_square_one_of_the_same_flops() -> None:
    """With measured thin-matmul factors, a [16, 1024] x [1024, 1024] linear's compute is priced
    at the factor for d = 16; ops that are not matmuls, and profiles without factors, are not."""
    from planner.cost import _thinnest_dim, compute_time
    from planner.hardware import CPU_GLOO
    from planner.mesh import Mesh
    from planner.models.mlp import MLP, MLPConfig
    from planner.problem import build_problem
    from planner.trace import trace

    model = MLP(MLPConfig(in_features=1024, hidden=1024, out_features=8, n_layers=2))
    graph = trace(model, (torch.randn(16, 1024), torch.randint(0, 8, (16,))))
    mesh = Mesh(("dp", "tp"), (1, 1))
    problem = build_problem(graph, mesh, CPU_GLOO)
    node = next(n for n in graph.nodes.values() if n.target == "aten.linear.default" and n.out.shape == (16, 1024))
    s = problem.choices[node.name][0]
    assert _thinnest_dim(node, s, mesh, 1) == 16
    thin = CPU_GLOO.model_copy(update={"matmul_thin": {"torch.float32": [(8.0, 0.25), (32.0, 0.75)]}})
    assert thin.thin_factor("torch.float32", 16) == pytest.approx(0.5)
    base, slow = compute_time(node, s, mesh, CPU_GLOO, 0), compute_time(node, s, mesh, thin, 0)
    flops_t = (node.flops_fwd + node.flops_bwd) / (CPU_GLOO.efficiency("torch.float32", node.flops_fwd) * CPU_GLOO.flops("torch.float32"))
    assert slow - 3 * CPU_GLOO.op_overhead == pytest.approx(2 * flops_t) and base - 3 * CPU_GLOO.op_overhead == pytest.approx(flops_t)
    other = next(n for n in graph.nodes.values() if n.kind == "op" and n.target == "aten.gelu.default")
    so = problem.choices[other.name][0]
    assert compute_time(other, so, mesh, thin, 0) == compute_time(other, so, mesh, CPU_GLOO, 0)


def test_overlap_efficiency_is_the_share_of_the_shorter_side_hidden_clipped_to_0_1() -> None:
    from planner.runtime.calibrate import overlap_efficiency

    # 10 ms of compute and 8 ms of all-reduce: 12 ms together hides 6 of the 8 ms
    assert overlap_efficiency([(1, 0.010, 0.008, 0.012)]) == pytest.approx(0.75)
    assert overlap_efficiency([(1, 0.010, 0.008, 0.020)]) == 0.0  # slower together than apart: nothing hidden
    assert overlap_efficiency([(1, 0.010, 0.008, 0.009)]) == 1.0
    assert overlap_efficiency([(1, 0.01, 0.01, 0.015), (2, 0.01, 0.01, 0.019), (3, 0.01, 0.01, 0.011)]) == pytest.approx(0.5)  # the median
