"""profile.json (`pipeflow.profile/1`): Profile and LayerProfile dataclasses, load/save/validate. docs/formats.md
says what every field means; this module checks them.

Optional fields (a file without them is read as before, and readers that ignore unknown keys read files with them): per
layer the backward with gradients already there (`backward_accumulate_ms`), its W share (`backward_weight_ms`), the
same times with gemm accumulation (`*_gemm_ms`, partitioner/accumulation.py), the parameters without gradient
(`frozen_bytes`, within parameter_bytes), the buffers (`buffer_bytes`) and what of its input and output the backward
keeps (`saved_input_bytes`, `saved_output_bytes`: a stage holds the rest of its received input and sent output per
microbatch in flight); at the top the loss (`loss_ms`, `loss_bytes`, `loss_saved_bytes`), the update and a weight copy
per byte (`optimizer_ms_per_byte`, `copy_ms_per_byte`), the contention beside busy ranks (`contention`,
`ranks_per_host`), the layers sharing parameters (`ties`, partitioner/ties.py), how the layers were timed (`timing`),
the measured link (`link_bandwidth`), the runtime's own costs from a traced run (`python -m partitioner.calibrate`:
RUNTIME_NUMBERS, `compute_factor`), and other microbatch sizes (`other_microbatch_sizes`: complete profiles of the same
layers, for `pipeflow-plan --global-batch`; the top level is the first size, so older readers see a one-size profile).
The planner uses them when present and counts them as 0 (or backward_ms) when absent.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner.jsonfile import check_fields, field_problem, read_json, show, write_json
from partitioner.ties import tie_problem

PROFILE_FORMAT = "pipeflow.profile/1"
LAYER_NUMBERS = ("forward_ms", "backward_ms", "output_bytes", "activation_bytes", "parameter_bytes")
# gemm: the same times with every nn.Linear adding its weight gradient into .grad inside the GEMM
GEMM_NUMBERS = ("forward_gemm_ms", "backward_gemm_ms", "backward_accumulate_gemm_ms")
MEMORY_NUMBERS = ("frozen_bytes", "buffer_bytes", "saved_input_bytes", "saved_output_bytes")  # LayerCosts reads them
OPTIONAL_LAYER_NUMBERS = ("backward_accumulate_ms", "backward_weight_ms", *GEMM_NUMBERS, *MEMORY_NUMBERS)
RUNTIME_NUMBERS = ("action_ms", "message_ms", "latency_ms", "step_gap_ms", "layer_ms", "update_ms")  # optional
MAX_COMPUTE_FACTOR = 100.0
CALIBRATED = (*RUNTIME_NUMBERS, "compute_factor", "link_bandwidth")  # what partitioner.calibrate may write
TIMINGS = ("idle", "kernels", "stage", "graphs")  # pipeflow-profile --timing (partitioner.measure: Timer, time_chain)
DTYPES = ("float32", "bfloat16", "float16", "float64")
# Upper bounds of a plausible measurement: sums over layers and microbatches must stay finite in float64
# (a time of 1e308 ms overflows to inf once multiplied by m and used to look like "no plan").
MAX_MS = 1e9  # 11.6 days for one layer and one microbatch
MAX_BYTES = 2.0**60  # 1 EiB
# Lower bound of a plausible bandwidth (bytes/s, a profile's link_bandwidth and --topology's levels): 1 kB/s, below
# any network link (a 56k modem moves 7 kB/s) and below the all-reduce partitioner.calibrate reads from a tiny
# model's trace, so only a slip of the unit (1e-30GB/s) is refused; MAX_BYTES over it, 1.2e18 ms, stays finite.
MIN_BANDWIDTH = 1e3


class ProfileError(ValueError):
    """A profile.json that is malformed or inconsistent; the one-line message names the field and value."""


def _is_number(x: Any) -> bool:
    """A JSON number that is finite: an int always is (math.isfinite overflows on one past float's range)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


@dataclass
class LayerProfile:
    """One layer, per microbatch: times in ms, sizes in bytes."""

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: int
    activation_bytes: int
    parameter_bytes: int
    backward_accumulate_ms: float | None = None
    backward_weight_ms: float | None = None  # the W share of backward_ms (split nn.Linear weight GEMMs)
    # forward_ms, backward_ms and backward_accumulate_ms with gemm accumulation (pipeflow/split.py), where
    # pipeflow-profile timed both ways (partitioner/accumulation.py)
    forward_gemm_ms: float | None = None
    backward_gemm_ms: float | None = None
    backward_accumulate_gemm_ms: float | None = None
    frozen_bytes: int | None = None  # parameters that do not require grad: no gradient, no optimizer state
    buffer_bytes: int | None = None  # buffers (BatchNorm's statistics, masks): held once per stage
    saved_input_bytes: int | None = None  # of its input, what its backward keeps
    saved_output_bytes: int | None = None  # of its output, what its backward keeps

    def check(self, where: str = "layer") -> None:
        if not isinstance(self.name, str):
            raise ProfileError(f"{where}.name must be a string, found {show(self.name)}")
        for key in LAYER_NUMBERS + OPTIONAL_LAYER_NUMBERS:
            v = getattr(self, key)
            if v is None and key in OPTIONAL_LAYER_NUMBERS:
                continue
            if not _is_number(v) or v < 0:
                raise ProfileError(f"{where}.{key} must be a non-negative number, found {show(v)}")
            limit = MAX_MS if key.endswith("_ms") else MAX_BYTES
            if v > limit:
                raise ProfileError(f"{where}.{key} must be at most {limit:g} "
                                   f"({'ms' if key.endswith('_ms') else 'bytes'}), found {show(v)}")
        for key, whole in (("frozen_bytes", "parameter_bytes"), ("saved_output_bytes", "output_bytes")):
            if (getattr(self, key) or 0) > getattr(self, whole):
                raise ProfileError(f"{where}.{key} must be at most its {whole} ({show(getattr(self, whole))}), found "
                                   f"{show(getattr(self, key))}")


@dataclass
class Profile:
    """What `pipeflow-profile` measured: one LayerProfile per entry of ModelSpec.layers, in order."""

    model: str
    model_args: dict[str, Any]
    device: str
    dtype: str
    microbatch_size: int
    layers: list[LayerProfile] = field(default_factory=list)
    loss_ms: float | None = None
    optimizer_ms_per_byte: dict[str, float] = field(default_factory=dict)
    others: list[Profile] = field(default_factory=list)  # the same layers at other microbatch sizes
    link_bandwidth: float | None = None  # bytes/s between two devices, measured (CUDA, >1 GPU)
    action_ms: float | None = None  # the runtime's own time per forward or backward of a stage (calibrated)
    message_ms: float | None = None  # the sender's time per message between stages (calibrated)
    latency_ms: float | None = None  # a message's delay beyond bytes / bandwidth, off the link (calibrated)
    step_gap_ms: float | None = None  # the runtime's time between two steps, once per step (calibrated)
    layer_ms: float | None = None  # the runtime's own time per layer of a stage, per forward or backward (calibrated)
    update_ms: float | None = None  # the runtime's own time per optimizer update beyond its profile (calibrated)
    compute_factor: float | None = None  # the layers' time in a running stage / as profiled (calibrated)
    timing: str | None = None  # how the layers were timed (pipeflow-profile --timing; CPU: only "stage" is written)
    loss_bytes: float | None = None  # the loss's memory beyond its input, forward to backward (layermem.loss_bytes)
    loss_saved_bytes: float | None = None  # of it, what the loss's backward keeps: held per microbatch in flight
    ranks_per_host: int | None = None  # timed beside this many - 1 busy companions (pipeflow-profile --ranks-per-host)
    copy_ms_per_byte: float | None = None  # one copy of the weights per byte (a stashed version; measure.py)
    contention: float | None = None  # a pass beside ranks_per_host - 1 busy companions over one alone (companion.py)
    ties: list[dict[str, Any]] | None = None  # layers sharing parameters, and the bytes they share (ties.py)
    # not in the file: the device's peak while profiling (layermem.loss_bytes resets CUDA's peak statistic)
    device_peak_bytes: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def with_costs(self, found: dict[str, float]) -> Profile:
        """A copy with the runtime's costs `found` (partitioner.calibrate's keys) at every microbatch size of it:
        they are the machine's, not the size's."""
        out = copy.deepcopy(self)
        for prof in out.at_sizes():
            for key, value in found.items():
                setattr(prof, key, value)
        return out

    def at_sizes(self) -> list[Profile]:
        """This profile and those at its other microbatch sizes, by size."""
        return sorted([self, *self.others], key=lambda p: p.microbatch_size)

    def validate(self, source: str = "profile") -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ProfileError(f"{source}: model must be a non-empty string, found {show(self.model)}")
        if not isinstance(self.model_args, dict):
            raise ProfileError(f"{source}: model_args must be an object, found {show(self.model_args)}")
        if not isinstance(self.device, str) or not self.device:
            raise ProfileError(f"{source}: device must be a non-empty string, found {show(self.device)}")
        if self.dtype not in DTYPES:
            raise ProfileError(f"{source}: dtype must be one of {', '.join(DTYPES)}, found {show(self.dtype)}")
        mb = self.microbatch_size
        if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
            raise ProfileError(f"{source}: microbatch_size must be a positive integer, found {show(mb)}")
        if mb > MAX_BYTES:  # a sample takes a byte at least
            raise ProfileError(f"{source}: microbatch_size must be at most {MAX_BYTES:g}, found {show(mb)}")
        if not self.layers:
            raise ProfileError(f"{source}: layers is empty: expected one entry per model layer")
        for i, layer in enumerate(self.layers):
            layer.check(f"{source}: layers[{i}]")
        if self.loss_ms is not None and (not _is_number(self.loss_ms) or not 0 <= self.loss_ms <= MAX_MS):
            raise ProfileError(f"{source}: loss_ms must be a number in [0, {MAX_MS:g}], found {show(self.loss_ms)}")
        for key in ("loss_bytes", "loss_saved_bytes"):
            v = getattr(self, key)
            if v is not None and (not _is_number(v) or not 0 <= v <= MAX_BYTES):
                raise ProfileError(f"{source}: {key} must be a number in [0, {MAX_BYTES:g}], found {show(v)}")
        opt = self.optimizer_ms_per_byte
        if not isinstance(opt, dict) or not all(isinstance(k, str) and _is_number(v) and 0 <= v <= MAX_MS
                                                for k, v in opt.items()):
            raise ProfileError(f"{source}: optimizer_ms_per_byte must map optimizer names to non-negative "
                               f"numbers, found {show(opt)}")
        for key in RUNTIME_NUMBERS:
            v = getattr(self, key)
            if v is not None and (not _is_number(v) or not 0 <= v <= MAX_MS):
                raise ProfileError(f"{source}: {key} must be a number in [0, {MAX_MS:g}] (ms), found {show(v)}")
        for key in ("compute_factor", "contention"):
            f = getattr(self, key)
            if f is not None and (not _is_number(f) or not 0 < f <= MAX_COMPUTE_FACTOR):
                raise ProfileError(f"{source}: {key} must be a number in (0, {MAX_COMPUTE_FACTOR:g}], found {show(f)}")
        c = self.copy_ms_per_byte
        if c is not None and (not _is_number(c) or not 0 <= c <= MAX_MS):
            raise ProfileError(f"{source}: copy_ms_per_byte must be a number in [0, {MAX_MS:g}], found {show(c)}")
        r = self.ranks_per_host
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ProfileError(f"{source}: ranks_per_host must be a positive integer, found {show(r)}")
        if self.timing is not None and self.timing not in TIMINGS:
            raise ProfileError(f"{source}: timing must be one of {', '.join(TIMINGS)}, found {show(self.timing)}")
        bw = self.link_bandwidth
        if bw is not None and (not _is_number(bw) or not MIN_BANDWIDTH <= bw < MAX_BYTES):
            raise ProfileError(f"{source}: link_bandwidth must be a number of bytes/s from {MIN_BANDWIDTH:g} (1 kB/s) "
                               f"to below {MAX_BYTES:g}, found {show(bw)}")
        why = None if self.ties is None else tie_problem(self.ties, self.column("parameter_bytes"), MAX_BYTES)
        if why:
            raise ProfileError(f"{source}: {why}")
        sizes = [mb]
        for k, other in enumerate(self.others):
            where = f"{source}: other_microbatch_sizes[{k}]"
            if other.microbatch_size in sizes:
                raise ProfileError(f"{where}: microbatch_size {other.microbatch_size} appears twice; expected one "
                                   "profile per size")
            odd = next((f for f in ("model", "model_args", "device", "dtype") if getattr(other, f) != getattr(self, f)),
                       None)
            if odd is not None:
                raise ProfileError(f"{where}: {odd} must be the top level's {show(getattr(self, odd))} (the same model "
                                   f"at another microbatch size), found {show(getattr(other, odd))}")
            if [x.name for x in other.layers] != [x.name for x in self.layers] or other.others:
                raise ProfileError(f"{where}: expected the same {len(self.layers)} layers as the top level, "
                                   f"found {len(other.layers)} layers named differently or nested sizes")
            sizes.append(other.microbatch_size)

    # Per-layer columns, for the planner.
    def column(self, key: str) -> list[float]:
        return [float(getattr(layer, key)) for layer in self.layers]

    def backward_column(self, *, accumulate: bool) -> list[float]:
        """backward_ms, or backward_accumulate_ms where measured when gradients accumulate."""
        return [float(x.backward_accumulate_ms if accumulate and x.backward_accumulate_ms is not None
                      else x.backward_ms) for x in self.layers]

    def weight_column(self) -> list[float]:
        """Per layer the W share of its backward (zero-bubble schedules): backward_weight_ms where measured,
        else estimated as half of backward_ms for a layer with parameters (weight and input GEMMs cost alike)
        and 0 for one without; never more than backward_ms."""
        return [min(float(x.backward_ms), float(x.backward_weight_ms) if x.backward_weight_ms is not None
                    else 0.5 * x.backward_ms if x.parameter_bytes > 0 else 0.0) for x in self.layers]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": PROFILE_FORMAT, "model": self.model, "model_args": self.model_args,
                             "device": self.device, "dtype": self.dtype, "microbatch_size": self.microbatch_size,
                             "layers": [{k: v for k, v in asdict(layer).items()
                                         if v is not None or k not in OPTIONAL_LAYER_NUMBERS}
                                        for layer in self.layers]}
        if self.loss_ms is not None:
            d["loss_ms"] = self.loss_ms
        if self.optimizer_ms_per_byte:
            d["optimizer_ms_per_byte"] = self.optimizer_ms_per_byte
        if self.others:
            d["other_microbatch_sizes"] = [other.to_json() for other in self.others]
        if self.link_bandwidth is not None:
            d["link_bandwidth"] = self.link_bandwidth
        if self.timing is not None:
            d["timing"] = self.timing
        d.update({k: getattr(self, k) for k in (*RUNTIME_NUMBERS, "compute_factor", "ranks_per_host", "loss_bytes",
                                                "loss_saved_bytes", "copy_ms_per_byte", "contention", "ties")
                  if getattr(self, k) is not None})
        return d

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def from_json(cls, d: Any, *, source: str = "profile") -> Profile:
        d = check_fields(d, dict.fromkeys(("model", "device", "dtype", "microbatch_size", "layers")), source=source,
                         error=ProfileError, format=PROFILE_FORMAT, show=show)
        if not isinstance(d["layers"], list):
            raise ProfileError(f"{source}: layers must be a list, found {show(d['layers'])}")
        layers = []
        for i, entry in enumerate(d["layers"]):
            where = f"{source}: layers[{i}]"
            if not isinstance(entry, dict):
                raise ProfileError(f"{where} must be an object, found {show(entry)}")
            problem = field_problem(entry, dict.fromkeys(("name", *LAYER_NUMBERS)))
            if problem is not None:
                raise ProfileError(f"{where}: {problem}")
            layer = LayerProfile(**{k: entry[k] for k in ("name", *LAYER_NUMBERS, *OPTIONAL_LAYER_NUMBERS)
                                    if k in entry})
            layer.check(where)
            layers.append(layer)
        others = d.get("other_microbatch_sizes", [])
        if not isinstance(others, list):
            raise ProfileError(f"{source}: other_microbatch_sizes must be a list, found {show(others)}")
        others = [cls.from_json({"ties": d.get("ties"), **o} if isinstance(o, dict) else o,  # the same layers' ties
                                source=f"{source}: other_microbatch_sizes[{k}]") for k, o in enumerate(others)]
        try:
            return cls(d["model"], d.get("model_args", {}), d["device"], d["dtype"], d["microbatch_size"], layers,
                       d.get("loss_ms"), d.get("optimizer_ms_per_byte", {}), others,
                       link_bandwidth=d.get("link_bandwidth"), action_ms=d.get("action_ms"),
                       message_ms=d.get("message_ms"), latency_ms=d.get("latency_ms"),
                       step_gap_ms=d.get("step_gap_ms"), layer_ms=d.get("layer_ms"), update_ms=d.get("update_ms"),
                       compute_factor=d.get("compute_factor"), timing=d.get("timing"),
                       loss_bytes=d.get("loss_bytes"), ranks_per_host=d.get("ranks_per_host"),
                       loss_saved_bytes=d.get("loss_saved_bytes"),
                       copy_ms_per_byte=d.get("copy_ms_per_byte"), contention=d.get("contention"), ties=d.get("ties"))
        except ProfileError as e:
            # __post_init__ validated with the default source name; say which file.
            raise ProfileError(str(e).replace("profile: ", f"{source}: ", 1)) from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(read_json(path, "profile.json", ProfileError), source=Path(path).name)

