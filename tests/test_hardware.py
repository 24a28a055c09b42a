"""Hardware presets are typed data whose numbers say where they come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.hardware import PRESETS, HardwareProfile, load_profile


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_cites_a_source_for_its_numbers(name: str) -> None:
    profile = PRESETS[name]
    for key in ("peak_flops", "memory_bandwidth", "intra_node", "inter_node", "latency", "compute_efficiency", "bandwidth_efficiency"):
        assert profile.sources.get(key), (name, key)
    assert profile.inter_node.bandwidth < profile.intra_node.bandwidth


def test_presets_cover_the_machines_the_papers_and_users_have() -> None:
    assert {"a100-80g", "v100-16g", "h100-80g", "h200-141g"} <= set(PRESETS)
    assert PRESETS["v100-16g"].devices_per_node == 4 and PRESETS["a100-80g"].devices_per_node == 8


def test_a_profile_file_round_trips_and_unknown_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(PRESETS["h200-141g"].model_dump_json())
    assert load_profile(str(path)) == PRESETS["h200-141g"]
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_profile("tpu")
    data = json.loads(path.read_text())
    data["typo"] = 1
    with pytest.raises(ValueError):
        HardwareProfile.model_validate(data)
