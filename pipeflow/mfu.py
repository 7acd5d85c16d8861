"""Model FLOPs utilisation (MFU, PaLM, Chowdhery et al. 2022, appendix B): the model's FLOPs per second over the
peak of the GPUs that ran it. The model's FLOPs per sample come from its spec (ModelSpec.flops_per_sample), the
peak from --peak-tflops or, on known GPUs, the table below (dense, no sparsity)."""
from __future__ import annotations

import torch

# (substring of torch.cuda.get_device_name(), TFLOP/s dense bf16/fp16 tensor cores, TFLOP/s fp32 without TF32),
# first match wins: the PCIe cards before their SXM names. From NVIDIA's data sheets.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),     # H100 SXM5
    ("H200", 989.0, 67.0),     # H200 SXM: H100's compute, more memory
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("A10G", 70.0, 31.2),
]


def peak_tflops(device: torch.device, dtype: torch.dtype | None, override: float | None = None) -> float | None:
    """Peak TFLOP/s of one device for `dtype`: `override` (--peak-tflops) if given, else the table's entry for
    this CUDA device's name; None when unknown (a CPU, an unlisted GPU): then no MFU is reported."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half, single in PEAK_TFLOPS:
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else single
    return None


def mfu(samples_per_s: float, flops_per_sample: float | None, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation per device: achieved FLOP/s / (devices * peak FLOP/s); None without both inputs."""
    if not flops_per_sample or not peak or devices < 1:
        return None
    return samples_per_s * flops_per_sample / (devices * peak * 1e12)
