"""Bytes and seconds, printed and parsed the same way everywhere."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def format_bytes(n: float) -> str:
    """``80.00 GiB``, ``12.50 MiB``, ``20.0 KiB``, ``8 B``."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    if abs(n) >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{int(n)} B"


def format_seconds(x: float) -> str:
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def parse_bytes(text: str) -> float:
    """``80GiB``, ``40e9``, ``16 GB`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as bytes: use e.g. 80GiB, 40e9, 16GB")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]
