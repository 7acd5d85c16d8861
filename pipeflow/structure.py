"""What crosses a stage boundary when a layer returns more than a tensor or a flat tuple of tensors: nested tuples
and lists, dicts, None and other constants among the tensors (an attention layer's (output, None), a block's
(hidden, (key, value)), a dict of named tensors). The tensors travel every microbatch; the structure around them (a
torch.utils._pytree spec, as text, and the constants) travels once per input signature with their shapes (comm.P2P's
meta), and the receiving stage's first layer gets the same structure back, as in one process. A flat named tuple of
tensors arrives as a plain tuple, as before; a nested one is refused (torch cannot write its spec as text). One tensor
returned twice, (h, h), travels once and arrives as one tensor in both places, as in one process (an in-place change
to one is seen in the other; their gradients add up in one buffer). So does a tensor that is a view inside another
one returned beside it, (h, h[:, 0]) or (h, h.t()): it travels inside the other and arrives as the same view of it,
so an in-place change to either is seen in both, as in one process (sent apart, a change to one was lost to the
other: weights off by 0.06-0.13 after 3 steps); the other must be contiguous and hold the view's every element,
and the view be made from it by one torch view operation with no hook on it (`_view_of`)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from pipeflow.failure import UsageError

CONSTANTS = (type(None), bool, int, float, str)
# (spec as text, per leaf: None where the next tensor sent goes, k where the k-th sent goes again, (the constant,),
# or ("view", k, size, stride, offset, requires grad): a view of the k-th sent); None: a tensor, or a flat tuple of
# distinct tensors
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
    inside = _views(unique)
    if len(unique) == len(tensors) and not inside and isinstance(out, tuple) and len(out) > 1 and all(
            isinstance(v, torch.Tensor) for v in out):
        return tensors, None
    try:
        text = treespec_dumps(spec)
    except NotImplementedError:
        raise OutputError(f"a stage's output holds a {type(out).__name__} around other containers, whose structure "
                          f"cannot be sent to the next stage; expected tuples, lists and dicts") from None
    sending = [t for t in unique if id(t) not in inside]
    sent = {id(t): k for k, t in enumerate(sending)}  # id -> its index among the tensors sent
    marks: list[tuple[Any, ...] | int | None] = []
    placed: set[int] = set()
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            marks.append((leaf,))
        elif id(leaf) in inside:
            base = inside[id(leaf)]
            marks.append(("view", sent[id(base)], tuple(leaf.shape), leaf.stride(),
                          leaf.storage_offset() - base.storage_offset(), leaf.requires_grad))
        elif id(leaf) in placed:
            marks.append(sent[id(leaf)])
        else:
            placed.add(id(leaf))
            marks.append(None)
    return sending, (text, tuple(marks))


def _views(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """id -> the tensor among `tensors` that holds it, for each one whose elements all lie inside another contiguous
    one of the same storage and dtype (the largest such, the first of equals) and that is its view (`_view_of`)."""
    if len(tensors) < 2:
        return {}
    ptrs = [t.untyped_storage().data_ptr() if t.device.type != "meta" and t.numel() else None for t in tensors]
    if len({p for p in ptrs if p is not None}) == sum(p is not None for p in ptrs):
        return {}  # no two share memory: the common case, one storage lookup each

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = int(t.storage_offset())
        return lo, lo + 1 + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride()))

    spans = [span(t) if p is not None else (0, 0) for t, p in zip(tensors, ptrs)]
    out: dict[int, torch.Tensor] = {}
    for i, t in enumerate(tensors):
        if ptrs[i] is None:
            continue
        lo, hi = spans[i]
        holders = [(b_hi - b_lo, -j, b) for j, (b, (b_lo, b_hi)) in enumerate(zip(tensors, spans))
                   if ptrs[j] == ptrs[i] and b.dtype == t.dtype and b.is_contiguous() and b_lo <= lo and hi <= b_hi]
        if holders:
            base = max(holders, key=lambda h: h[:2])[2]
            if base is not t and _view_of(t, base):
                out[id(t)] = base
    return out


# torch's own view operations (their backward puts the gradient back where the view's elements lie in the base)
_VIEW_NODES = {"AliasBackward", "AsStridedBackward", "DiagonalBackward", "ExpandBackward", "PermuteBackward",
               "SelectBackward", "SliceBackward", "SplitBackward", "SplitWithSizesBackward", "SqueezeBackward",
               "TBackward", "TransposeBackward", "UnbindBackward", "UnsqueezeBackward", "ViewBackward"}


def _view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `t`'s gradient is the base's gradient where t's elements lie: t needs none, or one torch view
    operation made it from `base` and no hook reads its gradient. A custom Function whose forward returns a view (a
    gradient-reversal layer), a hook on t, or a chain of operations in between have their own backward: t travels
    apart, as before."""
    if not t.requires_grad:
        return True
    node = t.grad_fn
    if node is None or not base.requires_grad or t._backward_hooks or t.retains_grad:
        return False
    if node.name().rstrip("0123456789") not in _VIEW_NODES or len(node.next_functions) != 1:
        return False
    parent = node.next_functions[0][0]
    return parent is base.grad_fn if base.grad_fn is not None else getattr(parent, "variable", None) is base


def join(tensors: list[torch.Tensor], tree: Tree) -> Any:
    """The received tensors in the structure the sender's layer returned them in (views rebuilt on them: pass the
    tensors the layers are to see, received.py's aliases, so that a view is one of what they see)."""
    if tree is None:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    text, marks = tree
    given, leaves = iter(tensors), []
    for mark in marks:
        if mark is None:
            leaves.append(next(given))
        elif isinstance(mark, int):
            leaves.append(tensors[mark])
        elif len(mark) == 6 and mark[0] == "view":
            _, k, size, stride, offset, grad = mark
            base = tensors[k] if grad else tensors[k].detach()
            leaves.append(base.as_strided(size, stride, base.storage_offset() + offset))
        else:
            leaves.append(mark[0])
    return tree_unflatten(leaves, treespec_loads(text))
