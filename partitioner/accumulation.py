"""Gradient accumulation as a planning decision (issue 15): autograd's, or inside each nn.Linear's weight GEMM
(`gemm`, pipeflow/split.py), whichever the profile timed faster for the plan.

Which is faster depends on where the stage's pace comes from. On 2 H100s (GPT 24 x 2048, bf16), `gemm` took 3-5%
off the accumulating backward at microbatches 4 and 8 and ran 1f1b 1.1-2.9% faster, while at microbatch 2, where
a rank's host sets the pace, its Python autograd Function made the chain's forward 36% slower and 1f1b 18-25%
slower on some hosts (benchmarks/gpu/README.md). pipeflow-profile times the chain both ways on CUDA (the layers'
*_gemm_ms fields, partitioner/profiler.py); the planner plans with each and keeps the faster predicted step,
writing `"accumulation": "gemm"` in plan.json when that one wins; pipeflow-train runs the plan's choice unless
PIPEFLOW_GRAD_ACCUM says otherwise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, TypeVar

from partitioner.plan import Plan
from partitioner.profile import GEMM_NUMBERS, LayerProfile, Profile


class _Planned(Protocol):
    plan: Plan


P = TypeVar("P", bound=_Planned)  # partitioner.service.Planned


def _gemm_layer(x: LayerProfile) -> LayerProfile:
    assert x.forward_gemm_ms is not None and x.backward_gemm_ms is not None
    share = None if x.backward_weight_ms is None or not x.backward_ms else x.backward_weight_ms / x.backward_ms
    return replace(x, forward_ms=x.forward_gemm_ms, backward_ms=x.backward_gemm_ms,
                   backward_accumulate_ms=x.backward_accumulate_gemm_ms,
                   backward_weight_ms=None if share is None else share * x.backward_gemm_ms)


def gemm_variant(profile: Profile) -> Profile | None:
    """The profile with each layer's times as the ranks run them under gemm accumulation (its *_gemm_ms fields,
    the W share of the backward kept); None unless every layer, at every microbatch size, has them."""
    sizes = [profile, *profile.others]
    if not all(getattr(x, k) is not None for p in sizes for x in p.layers for k in GEMM_NUMBERS):
        return None
    return replace(profile, layers=[_gemm_layer(x) for x in profile.layers],
                   others=[replace(o, layers=[_gemm_layer(x) for x in o.layers]) for o in profile.others])


def priced_as(profile: Profile, accumulation: str | None) -> Profile:
    """The profile to price a plan that names `accumulation` with: gemm's times where the plan says gemm and
    the profile has them, else its own (a profile made under PIPEFLOW_GRAD_ACCUM=gemm holds gemm's already)."""
    return (gemm_variant(profile) or profile) if accumulation == "gemm" else profile


def plan_accumulation(plan_at: Callable[[Profile], P], profile: Profile) -> P:
    """plan_at(profile), and where the profile timed gemm accumulation too, plan_at of its gemm variant: the
    plan of higher predicted throughput (a tie, or a planning failure of gemm's, keeps autograd's), marked
    `"accumulation": "gemm"` in plan.json when gemm's wins."""
    first = plan_at(profile)
    gemm = gemm_variant(profile)
    if gemm is None:
        return first
    try:
        other = plan_at(gemm)
    except ValueError:  # PlanningError: gemm's times found no plan where autograd's did
        return first
    if other.plan.predicted["samples_per_s"] <= first.plan.predicted["samples_per_s"]:
        return first
    other.plan.extra["accumulation"] = "gemm"
    return other
