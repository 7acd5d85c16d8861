"""pipeflow/tensorops.py: an update's device work besides the optimizer step, as the guard and the weight stash
run it and pipeflow-profile times it."""
from __future__ import annotations

import pytest
import torch

from pipeflow.tensorops import LARGE, copy_weights, nonfinite_flag


def test_copy_weights_copies_every_tensor_large_and_small_exactly():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, generator=g, dtype=dt) for n, dt in ((LARGE, torch.float32), (LARGE - 1, torch.float64),
                                                              (7, torch.bfloat16), (LARGE + 3, torch.bfloat16),
                                                              (1, torch.float32))]
    dst = [torch.zeros_like(t) for t in src]
    copy_weights(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    with pytest.raises(ValueError):  # a missing destination is an error, not a silent partial copy
        copy_weights(dst[:-1], src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_nonfinite_flag(dtype, bad):
    grads = [torch.ones(5, dtype=dtype), torch.ones(3, 2, dtype=dtype), torch.ones(1, dtype=torch.float32)]
    if bad is not None:
        grads[1][2, 1] = bad
    flag = nonfinite_flag(grads, torch.device("cpu"))
    assert flag.dtype == torch.float32 and flag.item() == (0.0 if bad is None else 1.0)
    assert all(torch.isfinite(t).all() for k, t in enumerate(grads) if k != 1)  # the check leaves them as they were


def test_random_like_draws_for_a_dtype_without_a_normal_kernel() -> None:
    """A gradient for a float8 output (torch.randn_like has no float8 kernel on a CPU: planning on the spot of a
    model passing one between layers stopped with '"normal_kernel_cpu" not implemented for Float8_e4m3fn')."""
    import torch

    from pipeflow.tensorops import random_like

    t = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    g = random_like(t)
    assert g.dtype == torch.float8_e4m3fn and g.shape == (3, 4) and g.float().abs().sum() > 0
    assert random_like(torch.zeros(2, dtype=torch.float64)).dtype == torch.float64
