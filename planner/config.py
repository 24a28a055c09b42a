"""The search configuration: one frozen, typed value for everything a search depends on besides
the model and its batch.

Built from the CLI's flags, from Python (``SearchConfig(devices=64, zero=(0, 1, 2, 3))``), or from
a file (``planner report MODEL --config search.toml``: TOML or JSON, the same keys; a saved plan's
JSON works too, its ``search_config``), and stored in every plan the search returns, with the
hardware profile itself (not only its name), so a run can be repeated exactly. Unknown keys are
errors (``extra="forbid"``): a misspelt ``zeros = [0, 3]`` is named, not ignored.

    devices = 64
    hardware = "a100-80g"          # a preset, or a profile file written by planner calibrate
    zero = [0, 1, 2, 3]
    recompute = ["none", "full"]
    recompute_layers = [0.5, 1.0]  # half of each stack's layers, and all
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from planner.buckets import DEFAULT_BUCKET_BYTES
from planner.hardware import PRESETS, HardwareProfile, load_profile
from planner.schemes.tp import family_meshes
from planner.units import parse_bytes

Family = Literal["none", "1d", "2d", "3d"]
ALL_TP: tuple[Family, ...] = ("none", "1d", "2d", "3d")
Objective = Literal["time", "memory", "knee"]
Optimizer = Literal["adamw", "sgd-momentum"]  # the optimizers whose states and step planner.cost prices
Recompute = Literal["none", "selective", "full"]  # activation recomputation's modes (planner.schemes.recompute)
# a plan's recomputation: a mode, and for a part of each stack the share of its layers (``full 1/2``)
RecomputeSetting = Annotated[str, StringConstraints(pattern=r"^(none|(selective|full)( [1-9][0-9]*/[1-9][0-9]*)?)$")]


class SearchConfig(BaseModel):
    """What to search and how. ``tp``, ``zero``, ``cdp``, ``micro_batches``, ``recompute``: the
    values searched of each dimension (a configuration per combination that can run; a recomputing
    mode once per share of ``recompute_layers``);
    ``memory_budget``: bytes per device (None: the device's memory); ``front``: each
    configuration's time/memory front (False: its fastest plan only); ``resolution``,
    ``max_points``: the front's spacing and size (:func:`planner.sweep.sweep`); ``time_limit_s``,
    ``relative_gap``: each ILP solve's limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: int = Field(ge=1)
    hardware: HardwareProfile = PRESETS["a100-80g"]
    memory_budget: float | None = Field(default=None, gt=0)
    tp: tuple[Family, ...] = Field(default=ALL_TP, min_length=1)
    zero: tuple[Literal[0, 1, 2, 3], ...] = Field(default=(0,), min_length=1)
    cdp: tuple[Literal["off", "v1", "v2"], ...] = Field(default=("off",), min_length=1)
    cdp_stages: int = Field(default=4, ge=1)
    dp: int | None = Field(default=None, ge=1)
    micro_batches: tuple[int, ...] = Field(default=(1,), min_length=1)
    recompute: tuple[Recompute, ...] = Field(default=("none",), min_length=1)
    # the shares of each repeated stack's layers a recomputing mode recomputes (its first ones):
    # (0.5, 1.0) searches half the layers and all of them (planner.schemes.recompute)
    recompute_layers: tuple[float, ...] = Field(default=(1.0,), min_length=1)
    objective: Objective = "time"
    optimizer: Optimizer = "adamw"
    master_dtype: Literal["float32", "float64"] | None = None  # mixed precision: master weights and states in this dtype
    prefetch: bool = True  # ZeRO-3: gather each parameter one use ahead
    front: bool = True
    resolution: float = Field(default=0.05, ge=0, lt=1)
    max_points: int | None = Field(default=8, ge=2)
    bucket_bytes: int = Field(default=DEFAULT_BUCKET_BYTES, ge=1)
    time_limit_s: float = Field(default=120.0, gt=0)
    relative_gap: float = Field(default=1e-6, ge=0, lt=1)

    @field_validator("hardware", mode="before")
    @classmethod
    def _profile(cls, value: Any) -> Any:
        return load_profile(value) if isinstance(value, str) else value

    @field_validator("max_points", mode="before")
    @classmethod
    def _all(cls, value: Any) -> Any:
        return None if value == "all" else value  # (a file cannot write None: "all" is every point)

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("tp", "zero", "cdp", "micro_batches", "recompute", "recompute_layers", mode="before")
    @classmethod
    def _values(cls, value: Any) -> Any:
        """One value or a list; ``"0,1,2,3"`` as the CLI writes it."""
        if isinstance(value, str):
            return tuple(int(v) if v.strip().isdigit() else v.strip() for v in value.split(",") if v.strip())
        return value if isinstance(value, (list, tuple)) else (value,)

    @field_validator("recompute_layers", mode="after")
    @classmethod
    def _shares(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < v <= 1 for v in value):
            raise ValueError(f"recompute_layers are shares of each stack's layers, in (0, 1]: got {list(value)} (e.g. 0.25,0.5,1)")
        return value

    @model_validator(mode="after")
    def _counts(self) -> SearchConfig:
        if any(m < 1 for m in self.micro_batches):
            raise ValueError(f"micro_batches are counts >= 1, got {list(self.micro_batches)}")
        if self.recompute == ("none",) and self.recompute_layers != (1.0,):
            shares = ",".join(f"{v:g}" for v in self.recompute_layers)
            raise ValueError(f"recompute_layers {shares} are shares of the layers a recomputing mode recomputes, and recompute is none: "
                             f"search one (e.g. --recompute none,full --recompute-layers {shares})")
        if self.dp is not None and self.devices % self.dp:
            raise ValueError(f"dp = {self.dp} does not divide devices = {self.devices}")
        if not any(self.dp is None or m.group_size(m.dp_axes) == self.dp for f in self.tp for m in family_meshes(self.devices, f)):
            raise ValueError(self._no_mesh())
        if min(self.zero) > 0 and (self.dp == 1 or self.devices == 1):
            stages = ",".join(map(str, self.zero))
            raise ValueError(f"ZeRO {stages} shards over the data-parallel axis, and dp = 1 leaves none to shard over (every stage is "
                             "ZeRO 0 there): search zero 0 for the same plans, or let dp be > 1")
        return self

    def _no_mesh(self) -> str:
        """Why no mesh of the families asked for tiles the devices (with ``dp`` fixed, if it is)."""
        needs = {"none": f"dp = {self.devices}", "1d": "dp x tp with tp >= 2 dividing the device count",
                 "2d": "dp x q x q with q >= 2, q*q dividing the device count (4, 8, 9, 12, 16, ...)",
                 "3d": "dp x q x q x q with q >= 2, q^3 dividing the device count (8, 16, 24, 27, 32, ...)"}
        fixed = f" with dp = {self.dp}" if self.dp is not None else ""
        return (f"no mesh of tp {','.join(self.tp)} tiles {self.devices} devices{fixed} ("
                + "; ".join(f"{f}: {needs[f]}" for f in self.tp)
                + "): search another family (e.g. tp none,1d) or a device count these tile")

    @property
    def budget(self) -> float:
        """The memory budget per device in bytes: ``memory_budget``, or the device's memory."""
        return float(self.memory_budget if self.memory_budget is not None else self.hardware.device_memory)

    # ------------------------------------------------------------------ files

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> SearchConfig:
        """A TOML or JSON file of this class's keys, or a saved plan (its ``search_config``);
        ``overrides`` (e.g. the CLI's explicit flags) win over the file."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"search configuration file {path} does not exist")
        text = path.read_text()
        try:
            if path.suffix == ".toml":
                data = _toml(text, path)
            else:
                data = json.loads(text)
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"search configuration file {path} is not {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
        if isinstance(data, dict) and "search_config" in data:  # a saved plan
            if data["search_config"] is None:
                raise ValueError(f"{path} is a plan saved before plans carried their search configuration: give the search's flags instead")
            data = data["search_config"]
        if not isinstance(data, dict):
            raise ValueError(f"search configuration file {path} holds {type(data).__name__}, not a table of keys")
        return cls.build(source=str(path), **(data | overrides))

    @classmethod
    def build(cls, source: str = "the search configuration", **fields: Any) -> SearchConfig:
        """Validated, with a ``ValueError`` naming each bad key, what it got, and the keys there are."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = []
            errors = exc.errors()
            wrong = {e["loc"][0] for e in errors if e["type"] != "too_short" and e["loc"]}
            for e in [e for e in errors if not (e["type"] == "too_short" and e["loc"] and e["loc"][0] in wrong)][:5]:  # (an emptied list, once its values are named)
                key = ".".join(map(str, e["loc"])) or "<root>"
                if e["type"] == "extra_forbidden":
                    problems.append(f"unknown key {key!r} (known: {', '.join(cls.model_fields)})")
                elif not e["loc"]:  # a rule across keys (model_validator): its own words say which
                    problems.append(str(e["msg"]).removeprefix("Value error, "))
                else:
                    problems.append(f"{key} = {e.get('input')!r}: {e['msg']}")
            more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
            raise ValueError(f"{source}: {'; '.join(problems)}{more}") from None

    def to_toml(self) -> str:
        """This configuration as a file ``load`` reads back to an equal value (a calibrated
        profile, which no preset equals, is named in a comment: its numbers are in the saved plan,
        whose JSON ``load`` reads whole)."""
        lines = []
        for key, value in self.model_dump(mode="json").items():
            if key == "hardware":
                preset = PRESETS.get(self.hardware.name)
                if preset is not None and preset == self.hardware:
                    lines.append(f'hardware = "{self.hardware.name}"')
                else:
                    lines.append(f"# hardware: the calibrated profile {self.hardware.name!r} (in the saved plan's search_config)")
            elif key == "max_points" and value is None:
                lines.append('max_points = "all"')
            elif value is not None:
                lines.append(f"{key} = {json.dumps(value)}")
        return "\n".join(lines)


def _toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ValueError(f"reading {path} needs Python >= 3.11 or `pip install tomli`; or write the same keys as JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(str(exc)) from None
