"""What crosses a stage boundary when a layer returns more than a tensor or a flat tuple of tensors: nested tuples
and lists, dicts, None and other constants among the tensors (an attention layer's (output, None), a block's
(hidden, (key, value)), a dict of named tensors). The tensors travel every microbatch; the structure around them (a
torch.utils._pytree spec, as text, and the constants) travels once per input signature with their shapes (comm.P2P's
meta), and the receiving stage's first layer gets the same structure back, as in one process. A flat named tuple of
tensors arrives as a plain tuple, as before; a nested one is refused (torch cannot write its spec as text). One tensor
returned twice, (h, h), travels once and arrives as one tensor in both places, as in one process (an in-place change
to one is seen in the other; their gradients add up in one buffer)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from pipeflow.failure import UsageError

CONSTANTS = (type(None), bool, int, float, str)
# (spec as text, per leaf: None where the next tensor sent goes, k where the k-th sent goes again, else (the
# constant,)); None: a tensor, or a flat tuple of distinct tensors
Tree = tuple[str, tuple[tuple[Any, ...] | int | None, ...]] | None


class OutputError(UsageError):
    """A stage's output holds what cannot cross to the next stage: the profiler refuses it before any plan, the
    runtime (a split given by hand) at the first forward, each in one line."""


def shape_change(dst: int, before: Any, now: Any, signature: Any) -> OutputError:
    """The error for tensors between stages whose shapes changed for inputs of the same shapes (comm.P2P's meta,
    sent once per input signature: the receiver posts its receives from it). A data-dependent shape (x[mask]) does
    that; DeepSpeed's and torch's pipelines require static shapes between stages too."""
    def shapes(meta: Any) -> str:
        return ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d, _ in meta[0])
    return OutputError(f"the tensors sent to rank {dst} changed from [{shapes(before)}] to "
                       f"[{shapes(now)}] (or their structure) for inputs of the same shapes {signature}; what crosses "
                       "a stage boundary must depend on the input's shapes only: keep a data-dependent shape, as "
                       "x[mask], inside a stage, or pad it")


def split(out: Any) -> tuple[list[torch.Tensor], Tree]:
    """A layer's output as the tensors to send, depth first, and its structure (None when the receiver needs none)."""
    if isinstance(out, torch.Tensor):  # the common case, without the walk: host time at every forward
        return [out], None
    leaves, spec = tree_flatten(out)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *CONSTANTS)):
            raise OutputError(f"a stage's output may hold tensors and None, bool, int, float or str in tuples, lists "
                              f"and dicts; found {type(leaf).__name__}")
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    unique = list({id(t): t for t in tensors}.values())  # in order of first appearance
    if len(unique) == len(tensors) and isinstance(out, tuple) and len(out) > 1 and all(
            isinstance(v, torch.Tensor) for v in out):
        return tensors, None
    try:
        text = treespec_dumps(spec)
    except NotImplementedError:
        raise OutputError(f"a stage's output holds a {type(out).__name__} around other containers, whose structure "
                          f"cannot be sent to the next stage; expected tuples, lists and dicts") from None
    sent: dict[int, int] = {}  # id -> its index among the tensors sent
    marks: list[tuple[Any, ...] | int | None] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            marks.append((leaf,))
        elif id(leaf) in sent:
            marks.append(sent[id(leaf)])
        else:
            sent[id(leaf)] = len(sent)
            marks.append(None)
    return unique, (text, tuple(marks))


def join(tensors: list[torch.Tensor], tree: Tree) -> Any:
    """The received tensors in the structure the sender's layer returned them in."""
    if tree is None:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    text, marks = tree
    given, got, leaves = iter(tensors), [], []
    for mark in marks:
        if mark is None:
            got.append(next(given))
            leaves.append(got[-1])
        else:
            leaves.append(got[mark] if isinstance(mark, int) else mark[0])
    return tree_unflatten(leaves, treespec_loads(text))
