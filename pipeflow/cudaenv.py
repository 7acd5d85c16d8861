"""The CUDA environment a pipelined rank needs before its first CUDA call."""
from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch


def eager_cuda_modules(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Ask CUDA to load every kernel when its context is created (CUDA_MODULE_LOADING=EAGER) unless the user
    chose a mode; returns a warning when CUDA is already up in lazy mode (None otherwise).

    torch sets lazy loading by default, and under it the first launch of a kernel may wait for the whole device
    (CUDA C Programming Guide, "Lazy Loading": loading can require context synchronization). In a pipeline a
    rank's GPU nearly always runs a posted NCCL receive that waits for the peer's send: a rank loading a new
    kernel then waits for that send while the peer, loading one of its own, waits for this rank's next send.
    Async hung so on 2 GPUs at its first weight-stash copy (a kernel no earlier action had used) while the
    peer loaded its backward kernels. Call it before the first CUDA call of the process."""
    mode = environ.get("CUDA_MODULE_LOADING")
    if mode is None and not torch.cuda.is_initialized():
        environ["CUDA_MODULE_LOADING"] = "EAGER"
        return None
    if (mode or "LAZY").upper() != "EAGER" and torch.cuda.is_initialized():
        return ("CUDA was initialised with lazy module loading (CUDA_MODULE_LOADING unset or LAZY): the first "
                "launch of a kernel can wait for the whole GPU, which may deadlock against the pipeline's posted "
                "NCCL receives; set CUDA_MODULE_LOADING=EAGER before the first CUDA call")
    return None
