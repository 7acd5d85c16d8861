"""profile.json (`pipeflow.profile/1`): Profile and LayerProfile dataclasses, load/save/validate (docs/formats.md)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner.jsonfile import read_json

PROFILE_FORMAT = "pipeflow.profile/1"
LAYER_NUMBERS = ("forward_ms", "backward_ms", "output_bytes", "activation_bytes", "parameter_bytes")
DTYPES = ("float32", "bfloat16", "float16", "float64")


class ProfileError(ValueError):
    """A profile.json that is malformed or inconsistent; the one-line message names the field and value."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class LayerProfile:
    """One layer, per microbatch: times in ms, sizes in bytes."""

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: int
    activation_bytes: int
    parameter_bytes: int

    def check(self, where: str = "layer") -> None:
        if not isinstance(self.name, str):
            raise ProfileError(f"{where}.name must be a string, found {self.name!r}")
        for key in LAYER_NUMBERS:
            v = getattr(self, key)
            if not _is_number(v) or v < 0:
                raise ProfileError(f"{where}.{key} must be a non-negative number, found {_show(v)}")


@dataclass
class Profile:
    """What `pipeflow-profile` measured: one LayerProfile per entry of ModelSpec.layers, in order."""

    model: str
    model_args: dict[str, Any]
    device: str
    dtype: str
    microbatch_size: int
    layers: list[LayerProfile] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "profile") -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ProfileError(f"{source}: model must be a non-empty string, found {_show(self.model)}")
        if not isinstance(self.model_args, dict):
            raise ProfileError(f"{source}: model_args must be an object, found {_show(self.model_args)}")
        if not isinstance(self.device, str) or not self.device:
            raise ProfileError(f"{source}: device must be a non-empty string, found {_show(self.device)}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"{source}: dtype must be one of {', '.join(DTYPES)}, found {_show(self.dtype)}")
        mb = self.microbatch_size
        if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
            raise ProfileError(f"{source}: microbatch_size must be a positive integer, found {_show(mb)}")
        if not self.layers:
            raise ProfileError(f"{source}: layers is empty: expected one entry per model layer")
        for i, layer in enumerate(self.layers):
            layer.check(f"{source}: layers[{i}]")

    # Per-layer columns, for the planner.
    def column(self, key: str) -> list[float]:
        return [float(getattr(layer, key)) for layer in self.layers]

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "model": self.model, "model_args": self.model_args,
                "device": self.device, "dtype": self.dtype, "microbatch_size": self.microbatch_size,
                "layers": [asdict(layer) for layer in self.layers]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: Any, *, source: str = "profile") -> Profile:
        if not isinstance(d, dict):
            raise ProfileError(f"{source}: expected a JSON object, found {type(d).__name__}")
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{source}: format is {_show(d.get('format'))}, expected {PROFILE_FORMAT!r}")
        for key in ("model", "device", "dtype", "microbatch_size", "layers"):
            if key not in d:
                raise ProfileError(f"{source}: missing field {key!r}")
        if not isinstance(d["layers"], list):
            raise ProfileError(f"{source}: layers must be a list, found {_show(d['layers'])}")
        layers = []
        for i, entry in enumerate(d["layers"]):
            where = f"{source}: layers[{i}]"
            if not isinstance(entry, dict):
                raise ProfileError(f"{where} must be an object, found {_show(entry)}")
            for key in ("name", *LAYER_NUMBERS):
                if key not in entry:
                    raise ProfileError(f"{where}: missing field {key!r}")
            layer = LayerProfile(**{k: entry[k] for k in ("name", *LAYER_NUMBERS)})
            layer.check(where)
            layers.append(layer)
        try:
            return cls(d["model"], d.get("model_args", {}), d["device"], d["dtype"], d["microbatch_size"], layers)
        except ProfileError as e:
            # __post_init__ validated with the default source name; say which file.
            raise ProfileError(str(e).replace("profile: ", f"{source}: ", 1)) from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(read_json(path, "profile.json", ProfileError), source=Path(path).name)


def _show(v: Any) -> str:
    """A value as it appears in JSON, short."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
