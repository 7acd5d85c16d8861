"""What crosses a stage boundary when a layer returns more than a tensor or a flat tuple of tensors: nested tuples
and lists, dicts, None and other constants among the tensors (an attention layer's (output, None), a block's
(hidden, (key, value)), a dict of named tensors). The tensors travel every microbatch; the structure around them (a
torch.utils._pytree spec, as text, and the constants) travels once per input signature with their shapes (comm.P2P's
meta), and the receiving stage's first layer gets the same structure back, as in one process. A named tuple arrives as
itself where its class imports by its module and name (_named); one defined in a function arrives flat as a plain
tuple and is refused nested (torch cannot write its spec as text). One tensor
returned twice, (h, h), travels once and arrives as one tensor in both places, as in one process (an in-place change
to one is seen in the other; their gradients add up in one buffer). So does a tensor that is a view inside another
one returned beside it, (h, h[:, 0]) or (h, h.t()): it travels inside the other and arrives as the same view of it,
so an in-place change to either is seen in both, as in one process (sent apart, a change to one was lost to the
other: weights off by 0.06-0.13 after 3 steps); the other must be contiguous and hold the view's every element,
and the view be made from it by one torch view operation with no hook on it (`_view_of`). Other tensors that share
memory (chunks of one tensor, a view of a non-contiguous one or made by several operations) travel apart, and the
receiving stage stops in one line if its layers change one of them in place where it overlaps another (`check_shared`):
in one process the other would see the change."""
from __future__ import annotations

import collections
import functools
import importlib
import json
from typing import Any

import torch
from torch.utils import _pytree
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from pipeflow.failure import UsageError

CONSTANTS = (type(None), bool, int, float, str)
# Where a sent tensor lies in the memory it shares with others on the sending stage: (its index among the sent,
# size, stride, storage offset, bytes per element); strides and offset in elements.
Layout = tuple[int, tuple[int, ...], tuple[int, ...], int, int]
# (spec as text, per leaf: None where the next tensor sent goes, k where the k-th sent goes again, (the constant,),
# or ("view", k, size, stride, offset, requires grad): a view of the k-th sent; then the groups of sent tensors that
# share memory on the sending stage, as Layouts); None: a tensor, or a flat tuple of distinct tensors
Tree = tuple[str, tuple[tuple[Any, ...] | int | None, ...], tuple[tuple[Layout, ...], ...]] | None


class OutputError(UsageError):
    """A stage's output holds what cannot cross to the next stage: the profiler refuses it before any plan, the
    runtime (a split given by hand) at the first forward, each in one line."""


def shape_change(dst: int, before: Any, now: Any, signature: Any) -> OutputError:
    """The error for tensors between stages whose shapes (or structure) changed for inputs of the same shapes
    (comm.P2P's meta, sent once per input signature); DeepSpeed's and torch's pipelines require static shapes too."""
    def shapes(meta: Any, grad: bool = False) -> str:
        return ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" + (" requiring grad" if grad and g else "")
                         for s, d, g in meta[0])
    if shapes(before) == shapes(now) and before[1] == now[1]:  # what changed is requires_grad
        return OutputError(f"the tensors sent to rank {dst} changed from [{shapes(before, True)}] to "
                           f"[{shapes(now, True)}] for inputs of the same shapes {signature}: whether they require "
                           "grad must not change between microbatches of one step (a stage's output detached for some "
                           "only); between the steps of your own loop, Pipeline follows a change of requires_grad")
    if shapes(before) == shapes(now):  # the structure, or a constant's value: it travels once per input shape
        return OutputError(f"what is sent to rank {dst} beside the tensors [{shapes(now)}] changed for inputs of "
                           f"the same shapes {signature}: its structure or a constant (None, bool, int, float, str), "
                           "which must not depend on the data: return a value computed from it as a tensor")
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
    ptrs = _pointers(unique)  # one storage lookup each, for both walks
    inside = _views(unique, ptrs)
    sending = [t for t in unique if id(t) not in inside]
    shared = _shared(sending, [p for t, p in zip(unique, ptrs) if id(t) not in inside])
    if len(unique) == len(tensors) and not inside and not shared and isinstance(out, tuple) and len(out) > 1 and all(
            isinstance(v, torch.Tensor) for v in out) and (type(out) is tuple or _name_namedtuples(spec) is not True):
        return tensors, None  # a flat named tuple defined in a function: a plain tuple there
    named = _name_namedtuples(spec)  # not True: one the next stage cannot import by name
    try:
        text = treespec_dumps(spec)
    except NotImplementedError:
        what = (f"the named tuple {named} around other containers, which the next stage cannot import by that name "
                "(a class defined inside a function): define it at module level, or return" if named is not True else
                f"a {type(out).__name__} around other containers, whose structure cannot be sent to the next stage; "
                "expected")
        raise OutputError(f"a stage's output holds {what} tuples, lists and dicts") from None
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
    return sending, (text, tuple(marks), shared)


def _pointers(tensors: list[torch.Tensor]) -> list[int | None]:
    """Each tensor's storage address (None for one with no memory)."""
    return [t.untyped_storage().data_ptr() if t.device.type != "meta" and t.numel() else None for t in tensors]


def _shared(tensors: list[torch.Tensor], ptrs: list[int | None]) -> tuple[tuple[Layout, ...], ...]:
    """The groups of `tensors` (those sent; `ptrs`: their storages, `_pointers`) that share a storage, as their
    Layouts; () when none do."""
    by_storage: dict[int, list[int]] = {}
    for k, p in enumerate(ptrs):
        if p is not None:
            by_storage.setdefault(p, []).append(k)
    groups = [ks for ks in by_storage.values() if len(ks) > 1]
    # Offsets from the group's first element: the same for every microbatch of the same input shapes, wherever in
    # its storage the layer wrote (they travel once per input signature, with the shapes: comm.P2P's meta).
    first = [min(int(tensors[k].storage_offset()) for k in ks) for ks in groups]
    return tuple(tuple((k, tuple(tensors[k].shape), tuple(tensors[k].stride()), int(tensors[k].storage_offset()) - lo,
                        tensors[k].element_size()) for k in ks) for ks, lo in zip(groups, first))


def shared_versions(tensors: list[torch.Tensor], tree: Tree) -> list[int] | None:
    """Before the layers run on received `tensors`: the version counters of those that shared memory on the sending
    stage (None when none did), for `check_shared`."""
    if tree is None or not tree[2]:
        return None
    return [tensors[m[0]]._version for group in tree[2] for m in group]


def check_shared(tensors: list[torch.Tensor], tree: Tree, before: list[int], layers: str) -> None:
    """After the layers ran: an OutputError if they changed in place a received tensor where it overlaps another
    that shared its memory on the sending stage. The two arrived apart, so the other did not see the change, as it
    would in one process."""
    assert tree is not None
    versions = iter(before)
    for group in tree[2]:
        changed = [m for m in group if tensors[m[0]]._version != next(versions)]
        for a in changed:
            for b in group:
                if b is not a and _overlap(a, b):
                    leaf = [i for i, mark in enumerate(tree[1]) if mark is None]
                    raise OutputError(
                        f"{layers} changed in place a received tensor (leaf {leaf[a[0]]} of the previous "
                        f"stage's output, depth first) that shares memory there with leaf {leaf[b[0]]}; the two "
                        "cross apart (only a view made by one torch view operation of a contiguous tensor sent "
                        "beside it travels inside it), so the other would not see the change as in one process: "
                        "change a copy (x = x.clone()), or return a .clone() of one of them")


@functools.lru_cache(maxsize=64)
def _overlap(a: Layout, b: Layout) -> bool:
    """Whether two layouts on one storage share an element: each of a's elements (a slice of its outermost
    dimension at a time) is located in b by dividing its offset by b's strides, largest first, which is exact when
    each of b's strides exceeds the span of the smaller ones (any view made by torch's view operations of a tensor
    without internal overlap; otherwise they count as overlapping). On the error's path only: a microbatch whose
    layers changed a shared tensor in place. Elements of different sizes count as overlapping."""
    if a[4] != b[4]:
        return True
    _, size, stride, offset, _ = a
    dims = sorted((st, n) for n, st in zip(b[1], b[2]) if n > 1 and st > 0)[::-1]
    if any(st <= sum((n - 1) * s for s, n in dims[d + 1:]) for d, (st, _) in enumerate(dims)):
        return True  # strides that do not nest (only as_strided makes them): the division is not exact
    inner = torch.zeros((), dtype=torch.int64)
    for n, st in list(zip(size, stride))[1:]:
        inner = (inner.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st)
    for i in range(size[0] if size else 1):
        rel = (inner.flatten() + offset + (i * stride[0] if size else 0)) - b[3]
        found = rel >= 0
        for st, n in dims:
            k = torch.clamp(torch.div(rel, st, rounding_mode="floor"), 0, n - 1)
            rel = rel - k * st
        if bool((found & (rel == 0)).any()):
            return True
    return False


def _views(tensors: list[torch.Tensor], ptrs: list[int | None]) -> dict[int, torch.Tensor]:
    """id -> the tensor among `tensors` (`ptrs`: their storages, `_pointers`) that holds it, for each one whose
    elements all lie inside another contiguous one of the same storage and dtype that it is a view of (`_view_of`;
    the largest such, the first of equals, itself inside none)."""
    if len(tensors) < 2:
        return {}
    if len({p for p in ptrs if p is not None}) == sum(p is not None for p in ptrs):
        return {}  # no two share memory: the common case, one storage lookup each
    # each tensor's first element and one past its last, in elements of its storage
    spans = [(int(t.storage_offset()), int(t.storage_offset()) + 1 + sum((int(n) - 1) * int(st) for n, st in
                                                                          zip(t.shape, t.stride())))
             if p is not None else (0, 0) for t, p in zip(tensors, ptrs)]
    out: dict[int, torch.Tensor] = {}
    bases: set[int] = set()  # a base travels: never inside another
    for i, t in enumerate(tensors):
        if ptrs[i] is None or id(t) in bases:
            continue
        lo, hi = spans[i]
        holders = sorted(((b_hi - b_lo, -j, b) for j, (b, (b_lo, b_hi)) in enumerate(zip(tensors, spans))
                          if ptrs[j] == ptrs[i] and b.dtype == t.dtype and b.is_contiguous() and b_lo <= lo
                          and hi <= b_hi and b is not t and id(b) not in out), key=lambda h: h[:2], reverse=True)
        base = next((b for _, _, b in holders if _view_of(t, b)), None)  # (h.view(...), h): h, not the first
        if base is not None:
            out[id(t)] = base
            bases.add(id(base))
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
    text, marks, _ = tree
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
    try:
        spec = treespec_loads(text)
    except NotImplementedError:  # a named tuple this rank has not named yet (the sender did: _name_namedtuples)
        spec = treespec_loads(_import_namedtuples(text))
    return tree_unflatten(leaves, spec)


@functools.cache
def _named(cls: type) -> str | None:
    """`cls`'s module.qualname, registered with torch's pytree so that a spec's text names it; None where that name
    does not import back to it (a class defined inside a function)."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    found: Any = importlib.import_module(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        return None
    _pytree._register_namedtuple(cls, serialized_type_name=name)
    return name


def _name_namedtuples(spec: TreeSpec) -> bool | str:
    """Name every named tuple class in `spec` (_named): True, or the first that has no importable name."""
    stack = [spec]
    while stack:
        node = stack.pop()
        cls = node.context if node.type is collections.namedtuple else node.type  # torch's generic entry, or its own
        if isinstance(cls, type) and _pytree.is_namedtuple_class(cls) and _named(cls) is None:
            return f"{cls.__module__}:{cls.__qualname__}"
        stack.extend(node.children())
    return True


def _import_namedtuples(text: str) -> str:
    """Import and name the named tuple classes `text` (a spec) holds, as the sending rank named them (_named)."""
    stack = [json.loads(text)[1]]
    while stack:
        node = stack.pop()
        if node["type"] == "collections.namedtuple":
            module, _, qualname = node["context"].partition(":")
            found: Any = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
            _named(found)
        stack.extend(node["children_spec"])
    return text
