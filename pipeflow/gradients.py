"""Gradients sent back between stages: for each tensor a stage received that requires grad, its gradient, or none.

In one process, parameters whose outputs the rest of the model does not use get no gradient: their `.grad` stays
None, and torch's optimizers leave them alone (no weight decay, no momentum, no Adam step). A stage whose layers
do not use a received tensor (a tuple member the next layers drop, an encoder output the last stage ignores) has
no gradient for it either. It used to send zeros instead, and the previous stage's parameters behind that tensor
got a zero `.grad`, which weight decay and Adam then moved (silently: the losses stayed the same). Now only the
gradients that exist travel, and the previous stage runs its backward from the outputs that got one.

Which gradients exist is sent once per channel and input signature, with their shapes (comm.P2P's meta): the
receiver posts its receives from it. It must not change between microbatches of the same shapes (a received
tensor used by some microbatches and not by others): that stops the run in one line, as a shape change does.
"""
from __future__ import annotations

from typing import Any

import torch

from pipeflow.structure import OutputError


def signature_of(forward: Any) -> tuple[str, Any]:
    """The key of the gradients sent back for the activations sent under the forward `signature`."""
    return ("B", forward)


def send_grads(p2p: Any, grads: list[torch.Tensor | None], dst: int, forward: Any) -> None:
    """Send to `dst` the gradients that exist, the first time for this signature with which ones they are."""
    present = [g is not None for g in grads]
    key = (p2p.world.rank, dst, signature_of(forward))
    cached = p2p.meta_cache.get(key)
    if cached is not None and cached[1] != present:
        raise OutputError(f"the gradients sent back to rank {dst} were {_which(cached[1])} and now {_which(present)} "
                          f"for inputs of the same shapes {forward}: a stage must use the same received tensors for "
                          "every microbatch (one that uses a tensor only sometimes: multiply it by 0 instead)")
    p2p.send([g for g in grads if g is not None], dst, "B", signature=signature_of(forward), tree=present)


def recv_grads(p2p: Any, src: int, forward: Any) -> tuple[list[torch.Tensor | None], list[Any]]:
    """Post the receives of the gradients `src` sends back (waiting for which ones, the first time): one entry per
    output sent, None where `src` has none; and the works to wait on."""
    bufs, works = p2p.recv(src, "B", signature=signature_of(forward))
    _, present = p2p.expect_meta(src, signature_of(forward))
    received = iter(bufs)
    return [next(received) if p else None for p in present], works


def _which(present: list[bool]) -> str:
    return "[" + ", ".join("a gradient" if p else "none" for p in present) + "]"
