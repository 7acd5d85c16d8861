"""Executes one rank's action list: compute, overlapped sends/receives, gradient reduction, steps."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from partitioner.plan import Plan
from pipeflow.comm import P2P, World, all_reduce, new_group, new_groups, p2p_group_options
from pipeflow.data.loader import MicrobatchLoader
from pipeflow.hooks import Timer, WeightPolicy
from pipeflow.kinds import Weights, schedule_kind
from pipeflow.reduce import GradReducer, Tie, find_ties
from pipeflow.schedule import Action, Kind, Schedule, generate
from pipeflow.spec import ModelSpec
from pipeflow.stage import Stage, mark_requires_grad

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, world: World, plan: Plan, spec: ModelSpec, *, schedule: str,
                 optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 loader: MicrobatchLoader, dtype: torch.dtype | None = None, total_steps: int = 1,
                 timer: Timer | None = None, vertical_sync: bool = False,
                 warmup: list[int] | None = None, segment_steps: int | None = None, seed: int = 0) -> None:
        # No reference to spec (its layer list) is kept: only this stage's layers stay alive (issue 10).
        self.world, self.plan, self.loader = world, plan, loader
        self.kind = schedule_kind(schedule)  # the schedule's rules (kinds.py)
        self.m = plan.microbatches
        self.total_steps = total_steps
        self.timer = timer or Timer()
        self.s, self.r = plan.stage_of_rank(world.rank)
        self.S = len(plan.stages)
        st = plan.stages[self.s]
        self.stage = Stage(spec.layers[st.layers[0]:st.layers[1]], start=st.layers[0], first=self.s == 0,
                           last=self.s == self.S - 1, loss_fn=spec.loss_fn, device=world.device, dtype=dtype,
                           seed=seed)
        if self.kind.split_backward:  # zero-bubble: B defers the Linear weight GEMMs to W (split.py)
            log.info("%s: B defers the weight gradients of %d nn.Linear module(s) to W", schedule,
                     len(self.stage.split_backward()))
        self.optimizer = optimizer_factory(self.stage.parameters())
        self.flush = self.kind.flush
        self.warmup, self.vertical_sync = warmup, vertical_sync
        # Flush schedules repeat one step's list; asynchronous ones run the microbatches of a segment
        # (`segment_steps` minibatches; default: the whole run) as one list (begin_segment).
        self._scheds: dict[int, Schedule] = {}
        self.mb_offset = 0  # asynchronous: global index of the current segment's microbatch 0
        self._use_schedule(1 if self.flush else (segment_steps or total_steps))
        # Parameters shared by layers of several stages (tied embedding and head): one logical parameter
        # whose gradient is summed over every stage and replica holding it (reduce.Tie, _step).
        self.ties = find_ties(spec.layers, [st.layers for st in plan.stages], [st.ranks for st in plan.stages])
        if self.ties and not self.kind.ties_allowed:
            raise ValueError(tied_async_error(self.ties, schedule))
        self.p2p = P2P(world, self._make_channels(), window=self._send_window())
        self.p2p.warm_up()
        self._logged_peak = 0
        tied = {id(p) for _, p in self._tied_here()}
        self.tie_reducers = [GradReducer(params, group, overlap=False) for params, group in self._tie_groups()]
        self.reducer: GradReducer | None = None
        if st.replicas > 1:
            group = self.replica_groups[tuple(st.ranks)]
            # async: PipeDream's replicas are DDP, an update takes the mean of their r gradients; flush
            # schedules scale each microbatch's loss by 1/m, so the sum is already the minibatch mean.
            self.reducer = GradReducer([p for p in self.stage.parameters() if id(p) not in tied], group,
                                       average=self.kind.mean_over_replicas)
        self.policy = WeightPolicy()
        self.step_guard: Callable[[], bool] | None = None
        if self.kind.weights is not Weights.LIVE:
            self._new_policy()
        # Microbatches one STEP of this stage consumes (over its replicas): async steps per backward.
        self.microbatches_per_step = self.kind.microbatches_per_update(self.m, st.replicas)
        self.losses: list[torch.Tensor] = []

    # ------------------------------------------------------------------ set-up

    def _use_schedule(self, steps: int) -> None:
        """The action list for `steps` minibatches (flush: one step's list, whatever `steps`)."""
        if steps not in self._scheds:
            mbs = self.m if self.flush else self.m * steps
            self._scheds[steps] = generate(self.kind.name, self.S, mbs, self.plan.replicas, minibatch=self.m,
                                           warmup=self.warmup)
        self.sched = self._scheds[steps]
        self.worker = self.sched.worker(self.s, self.r)
        self.actions: list[Action] = self.sched.actions[self.worker]
        if hasattr(self, "p2p"):
            self.p2p.set_window(self._send_window())

    def _send_window(self) -> int:
        """Sends a rank may keep before it waits for its oldest (comm.P2P), from M, the most microbatches
        any worker holds between F and B, and R, the most replicas: among 3(M + R) + 2 later sends, at least
        M + R are gradients or follow backwards, so the peers have gone past the oldest one's receive
        (they run F and B in microbatch order, at most M ahead). Under 1f1b M <= stages, whatever m."""
        most = 0
        for acts in self.sched.actions:
            held = 0
            for a in acts:
                held += (a.kind is Kind.F) - (a.kind is Kind.B)
                most = max(most, held)
        return 3 * (most + max(self.plan.replicas)) + 2

    def _new_policy(self) -> None:
        from pipeflow.stash import StashPolicy, version_fn  # stash.py subclasses WeightPolicy

        old = self.policy
        policy = StashPolicy(self.stage.module, self.actions, version_fn(
            self.sched, self.s, minibatch=self.m, vertical_sync=self.vertical_sync), sched=self.sched,
            worker=self.worker)
        if isinstance(old, StashPolicy):  # reuse the previous segment's (free) copies
            policy.pool = old.pool + list(old.copies.values())
            policy.allocated = old.allocated
        self.policy = policy

    def begin_segment(self, first_step: int, steps: int) -> None:
        """Asynchronous schedules: the next `run(self.actions)` trains minibatches [first_step,
        first_step + steps) as one list that fills and drains (stash.py, "Segments"): weight versions
        count from the weights at its start, microbatch indices are offset to the global data order."""
        if self.flush:
            raise RuntimeError("segments are for the asynchronous schedules (async, 2bw)")
        self._use_schedule(steps)
        self.mb_offset = first_step * self.m
        self._new_policy()

    def rank_of(self, worker: int) -> int:
        s, r = self.sched.workers[worker]
        return self.plan.stages[s].ranks[r]

    def _make_channels(self) -> dict[tuple[int, int, str], Any]:
        """Groups for every neighbouring pair (both directions) and every replicated stage, created in
        the same order on all ranks."""
        pairs: list[tuple[int, int, str]] = []
        for s in range(self.S - 1):
            for a in self.plan.stages[s].ranks:
                for b in self.plan.stages[s + 1].ranks:
                    pairs += [(a, b, "F"), (b, a, "B")]
        sets = [sorted((a, b)) for a, b, _ in pairs]
        # Two groups per pair: one per direction (see comm.P2P), so create each rank set twice.
        groups: dict[tuple[int, int, str], Any] = {}
        options = p2p_group_options(self.world.backend)
        for (a, b, d), ranks in zip(pairs, sets):
            groups[(a, b, d)] = new_group(ranks, options) if self.world.size > 1 else None
        replica_sets = [st.ranks for st in self.plan.stages if st.replicas > 1]
        self.replica_groups = new_groups(self.world, replica_sets)
        last = self.plan.stages[-1]
        self.loss_group = self.replica_groups.get(tuple(last.ranks)) if last.replicas > 1 else None
        # Tied parameters: one group per rank set holding one, after the others (Megatron's embedding group).
        self.tie_groups = new_groups(self.world, [t.ranks for t in self.ties])
        return groups

    def _tied_here(self) -> list[tuple[Tie, torch.nn.Parameter]]:
        """The ties this stage holds, each with its parameter as this stage's module holds it."""
        start, end = self.stage.start, self.stage.start + len(self.stage.module)
        out = []
        for t in self.ties:
            here = [(i, n) for i, n in t.uses if start <= i < end]
            if here:
                i, name = here[0]
                out.append((t, self.stage.module[i - start].get_parameter(name)))
        return out

    def _tie_groups(self) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """(this rank's tied parameters, group) per tie rank set this rank is in, in the same order on
        every rank, so that the all-reduces of _step are issued in one global order."""
        by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for t, p in self._tied_here():
            by_ranks.setdefault(tuple(t.ranks), []).append(p)
        return [(params, self.tie_groups[ranks]) for ranks, params in by_ranks.items()]

    # ------------------------------------------------------------------ execution

    def global_mb(self, step: int, i: int) -> int:
        return step * self.m + i if self.flush else self.mb_offset + i

    def run(self, actions: list[Action], step: int = 0, on_step: Callable[[int], None] | None = None) -> None:
        """Execute `actions`. For flush schedules `step` places microbatch i at global index step*m+i;
        `on_step(k)` is called after the k-th STEP of an asynchronous list."""
        recv_f: dict[int, tuple[list[torch.Tensor], list[Any]]] = {}
        recv_b: dict[int, tuple[list[torch.Tensor], list[Any]] | None] = {}
        outputs: dict[int, list[torch.Tensor]] = {}
        in_grads: dict[int, list[torch.Tensor]] = {}
        # The reducer is armed for the last backward before each STEP (its gradients are then final): the
        # last W where the backward is split, which follows every B.
        last = Kind.W if self.kind.split_backward else Kind.B
        seq = [a for a in actions if a.kind in (last, Kind.STEP)]
        arm_at = {b.microbatch for b, nxt in zip(seq, seq[1:]) if b.kind is last and nxt.kind is Kind.STEP}
        steps_done = 0
        for a in actions:
            i = a.microbatch
            if a.kind is Kind.RECV_F:
                assert i is not None
                j = self.global_mb(step, i)
                recv_f[i] = self.p2p.recv(self.rank_of(self.sched.peer(self.worker, a)), "F",
                                          signature=self.loader.signature(j))
            elif a.kind is Kind.RECV_B:
                assert i is not None
                # The gradient has the shapes of what we sent; if F(i) has not run yet, post at B(i).
                recv_b[i] = self._post_recv_b(a) if i in outputs else None
            elif a.kind is Kind.F:
                assert i is not None
                self._forward(step, i, recv_f, outputs)
            elif a.kind is Kind.SEND_F:
                assert i is not None
                with self.timer.span("SEND_F", i):
                    self.p2p.send(outputs[i], self.rank_of(self.sched.peer(self.worker, a)), "F",
                                  signature=self.loader.signature(self.global_mb(step, i)))
            elif a.kind is Kind.B:
                assert i is not None
                posted = recv_b.pop(i, None)
                if posted is None and not self.stage.last:
                    posted = self._post_recv_b(Action(Kind.RECV_B, i))
                if self.reducer is not None and last is Kind.B and i in arm_at and i in self.stage.saved:
                    self.reducer.arm(self.stage.saved[i].outputs)
                in_grads[i] = self._backward(i, posted)
                outputs.pop(i, None)
            elif a.kind is Kind.W:
                assert i is not None
                if self.reducer is not None and i in arm_at:
                    self.reducer.arm_params(self.stage.deferred_weights(i))
                with self.timer.span("W", i):
                    self.stage.backward_weights(i)
            elif a.kind is Kind.SEND_B:
                assert i is not None
                with self.timer.span("SEND_B", i):
                    self.p2p.send(in_grads.pop(i), self.rank_of(self.sched.peer(self.worker, a)), "B")
            elif a.kind is Kind.STEP:
                self._step()
                if on_step is not None:
                    on_step(steps_done)
                steps_done += 1
            else:
                raise RuntimeError(f"rank {self.world.rank}: the engine cannot run action {a}")
        self.p2p.wait_sends()
        if self.p2p.peak_pending > self._logged_peak:
            self._logged_peak = self.p2p.peak_pending
            log.info("sends held: peak %d (%d bytes), window %d", self.p2p.peak_pending,
                     self.p2p.peak_pending_bytes, self.p2p.window)
        if not self.flush:
            self.policy.finish()

    def _post_recv_b(self, a: Action) -> tuple[list[torch.Tensor], list[Any]]:
        assert a.microbatch is not None
        saved = self.stage.saved[a.microbatch].outputs
        meta = [(tuple(t.shape), t.dtype, False) for t in saved]
        return self.p2p.recv(self.rank_of(self.sched.peer(self.worker, a)), "B", meta=meta)

    def _forward(self, step: int, i: int, recv_f: dict[int, tuple[list[torch.Tensor], list[Any]]],
                 outputs: dict[int, list[torch.Tensor]]) -> None:
        j = self.global_mb(step, i)
        # A stage that is both first and last (data parallelism) reads the microbatch once.
        data = self.loader.microbatch(j) if self.stage.first or self.stage.last else None
        target = data[1] if data is not None and self.stage.last else None
        if self.stage.first:
            assert data is not None
            inputs: Any = data[0]
        else:
            bufs, works = recv_f.pop(i)
            with self.timer.span("WAIT_F", i):
                for w in works:
                    w.wait()
            meta = self.p2p.expect_meta(self.rank_of(self.sched.peer(self.worker, Action(Kind.RECV_F, i))),
                                        self.loader.signature(j))
            inputs = mark_requires_grad(bufs, [m[2] for m in meta])
        self.policy.before_forward(i)
        scale = self.kind.loss_scale(self.m)
        with self.timer.span("F", i):
            outs = self.stage.forward(i, inputs, target, loss_scale=scale, global_mb=j)
        self.policy.after_forward(i)
        if self.stage.last:
            self.losses.append(outs[0])
        outputs[i] = outs

    def _backward(self, i: int, posted: tuple[list[torch.Tensor], list[Any]] | None) -> list[torch.Tensor]:
        grads = None
        if posted is not None:
            grads, works = posted
            with self.timer.span("WAIT_B", i):
                for w in works:
                    w.wait()
        self.policy.before_backward(i)
        with self.timer.span("B", i):
            out = self.stage.backward(i, grads)
        self.policy.after_backward(i)
        return out

    def _step(self) -> None:
        with self.timer.span("STEP"):
            if self.reducer is not None:
                self.reducer.finish()
            for tie in self.tie_reducers:  # after the replicas' reduction, which excludes tied parameters
                tie.finish()
            self.policy.before_step()
            # guard.StepGuard: skips non-finite updates; agrees on stop/skip at step boundaries.
            if self.step_guard is None or self.step_guard():
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.policy.after_step()

    def train_step(self, step: int) -> None:
        """One minibatch of a flush schedule: its m microbatches, then the optimizer step."""
        self.run(self.actions, step)

    def take_loss(self, count: int) -> float | None:
        """Mean loss of the `count` microbatches run since the last call, summed over the last stage's
        replicas: the value on the rank that owns the loss (last stage, replica 0), None elsewhere.
        Reads the device, so call it only when the value is reported."""
        if not self.stage.last:
            return None
        local = torch.stack(self.losses).sum() if self.losses else torch.zeros((), device=self.world.device)
        self.losses.clear()
        if self.loss_group is not None:
            all_reduce(local, self.loss_group)
        return float(local) / count if self.r == 0 else None

    @property
    def owns_loss(self) -> bool:
        return self.stage.last and self.r == 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the model-wide keys of nn.Sequential(*spec.layers) ("3.weight")."""
        out = {}
        for k, v in self.stage.module.state_dict().items():
            idx, _, rest = k.partition(".")
            out[f"{int(idx) + self.stage.start}.{rest}"] = v.detach().cpu()
        return out


def tied_async_error(ties: list[Tie], schedule: str) -> str:
    """One line: why a tied parameter across stages cannot train under an asynchronous schedule."""
    t = ties[0]
    return (f"parameter {' = '.join(t.keys)} is shared by stages {', '.join(map(str, t.stages))}, which --schedule "
            f"{schedule} cannot train: its stages use different weight versions of one parameter. Use --schedule "
            "gpipe or 1f1b, or a plan that keeps the tied layers on one stage")
