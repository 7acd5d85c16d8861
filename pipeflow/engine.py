"""Executes one rank's action list: compute on the stage each action names, overlapped sends/receives, gradient
reduction, steps. Channel set-up is in links.py."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from partitioner.plan import Plan
from pipeflow.clip import grad_clip
from pipeflow.comm import P2P, World
from pipeflow.gradients import recv_grads, send_grads, signature_of
from pipeflow.graphs import make_stages, weight_hooks
from pipeflow.hooks import Feed, GateFactory, StepGate, Timer, Timing, WeightHooks, WeightPolicy
from pipeflow.kinds import Weights, schedule_kind
from pipeflow.links import arm_points, make_links, make_reducers, reduce_late, send_window, tied_async_error
from pipeflow.lossmean import mean_loss
from pipeflow.lrsched import LrSchedule, scheduled_lr
from pipeflow.receives import ForwardReceives
from pipeflow.reduce import find_ties
from pipeflow.schedule import Action, Kind, Schedule, generate
from pipeflow.shard import sharded
from pipeflow.spec import ModelSpec
from pipeflow.split import gemm_accumulation, linear_notes
from pipeflow.stage import Stage, mark_requires_grad
from pipeflow.stash import LiveWeights, segment_policy
from pipeflow.update import Update, optimizer_over

log = logging.getLogger(__name__)


class Engine:
    """One rank's share of the pipeline: the stages (model chunks) of its rank group, one per model stage k
    with k mod S its group (one stage unless the plan interleaves), and their single optimizer."""

    def __init__(self, world: World, plan: Plan, spec: ModelSpec, *, schedule: str,
                 optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 loader: Feed, dtype: torch.dtype | None = None, total_steps: int = 1,
                 timer: Timing | None = None, vertical_sync: bool = False,
                 warmup: list[int] | None = None, segment_steps: int | None = None, seed: int = 0,
                 step_gate: GateFactory | None = None, shard_optimizer: bool = False,
                 clip_norm: float | None = None, lr_schedule: LrSchedule | None = None) -> None:
        # No reference to spec (its layer list) is kept: only this rank's layers stay alive (issue 10).
        self.world, self.plan, self.loader = world, plan, loader
        self.kind = schedule_kind(schedule)  # the schedule's rules (kinds.py)
        self.m, self.total_steps = plan.microbatches, total_steps
        self.timer: Timing = timer or Timer()
        self.s, self.r = plan.stage_of_rank(world.rank)  # rank group (the stage, without interleaving), replica
        self.S, self.v = plan.groups, plan.virtual_stages
        self.stages = make_stages(spec.layers, plan, self.s, loss_fn=spec.loss_fn, device=world.device, dtype=dtype,
                                  seed=seed)  # GraphedStage under PIPEFLOW_CUDA_GRAPHS=1 (graphs.py)
        self.stage = self.stages[self.s]  # the first (with one stage per rank, the only) chunk here
        self.split = Kind.W if self.kind.split_backward else Kind.B  # zero bubble: B defers weight GEMMs to W
        fuse = gemm_accumulation(planned=plan.accumulation)  # PIPEFLOW_GRAD_ACCUM, else the plan's choice
        for line in linear_notes(self.stages.values(), split=self.kind.split_backward, fuse=fuse):
            log.info("%s: %s", schedule, line)
        self._parameters = list({id(p): p for c in self.stages.values() for p in c.parameters()}.values())  # fixed
        self.flush, self.vertical_sync = self.kind.flush, vertical_sync
        self.warmup = warmup if warmup is not None else plan.warmup  # None: the plan's (else the minimum)
        self._scheds: dict[int, Schedule] = {}  # flush: one step's list, repeated; asynchronous: a segment's
        self.mb_offset = 0  # asynchronous: global index of the current segment's microbatch 0
        self._use_schedule(1 if self.flush else (segment_steps or total_steps))
        # Tied parameters (embedding and head): one logical parameter, its gradient summed over all holders.
        self.ties = find_ties(spec.layers, [st.layers for st in plan.stages], [st.ranks for st in plan.stages])
        if self.ties and not self.kind.ties_allowed:
            raise ValueError(tied_async_error(self.ties, schedule))
        self.links = links = make_links(world, plan, self.ties)  # trainable.py builds the reducers again
        self.replica_groups, self.loss_group = links.replica_groups, links.loss_group
        self.p2p = P2P(world, links.p2p, window=send_window(self.sched))
        self.p2p.warm_up(links.reduce_keys)  # with the replicas' copy-engine channels (PIPEFLOW_REDUCE=ce)
        self._logged_peak = 0
        st = plan.stages[self.s]
        self.shard = sharded(self._parameters, st.replicas, self.r, self.replica_groups.get(tuple(st.ranks)),
                             st.ranks) if shard_optimizer or plan.shard_optimizer else None  # ZeRO stage 1
        self.optimizer = optimizer_over(optimizer_factory, self.shard.owned if self.shard else self.parameters(),
                                        world.device, world.mpi if world.size > 1 else None, f" (stage {self.s})")
        self.policy: WeightHooks = weight_hooks(self.stages)  # graphs.CaptureAtStep where stages replay graphs
        if self.kind.weights is not Weights.LIVE:
            self._new_policy()
        last, deferred = self.s == self.S - 1, isinstance(self.policy, LiveWeights)  # deferred: 2bw's last stage
        if self.shard is not None and (type(self.policy) is WeightPolicy or deferred):  # live weights, no graphs
            self.shard.arm([layer for c in self.stages.values() for layer in c.module])  # landing under forwards
        late = (deferred and clip_norm is None and reduce_late()  # clip.py: the norm of a final gradient
                and self.kind.reduce_waits_a_step(last, self.shard is not None))
        self.tie_reducers, self.reducers = make_reducers(self.stages, self.ties, links, st.ranks, self.kind,
                                                         self.p2p, late)
        clip = grad_clip(clip_norm, self._parameters, self.ties, self.stages, st.replicas, self.r, world, self.kind)
        self.microbatches_per_step = self.kind.microbatches_per_update(self.m, st.replicas)  # one STEP's, replicas
        lr = scheduled_lr(lr_schedule, self.optimizer, per_update=self.microbatches_per_step, microbatches=self.m)
        self.update = Update(self.optimizer, self.parameters(), self.shard, [*self.reducers.values(),
                             *self.tie_reducers], deferred=deferred, late=late, clip=clip, lr=lr,
                             broadcast_overlaps=self.kind.broadcast_overlaps(last))
        self.losses: list[torch.Tensor] = []
        self._step_losses = 0  # where the losses of the minibatch the next STEP ends start in self.losses
        self._received: dict[tuple[int, int], list[torch.Tensor]] = {}  # (stage, mb) -> received inputs, to B
        self.step_gate: StepGate | None = step_gate(self) if step_gate else None  # made last: it reads the engine

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of this rank's chunks, once (a tied one too), the live ones even during a stashed forward."""
        return list(self._parameters)

    def _use_schedule(self, steps: int) -> None:
        """The action list for `steps` minibatches (flush: one step's list, whatever `steps`)."""
        if steps not in self._scheds:
            mbs = self.m if self.flush else self.m * steps
            self._scheds[steps] = generate(self.kind.name, self.S, mbs, self.plan.replicas, minibatch=self.m,
                                           warmup=self.warmup, virtual_stages=self.v)
        self.sched = self._scheds[steps]
        self.worker = self.sched.worker(self.s, self.r)
        self.actions: list[Action] = self.sched.actions[self.worker]
        self._peers: dict[tuple[Kind, int | None, int | None], int] = {}
        if hasattr(self, "p2p"):
            self.p2p.set_window(send_window(self.sched))

    def _new_policy(self) -> None:
        self.policy = segment_policy(self.stage.module, self.sched, self.worker, self.s, minibatch=self.m,
                                     vertical_sync=self.vertical_sync, previous=self.policy,
                                     settle=lambda: self.update.settle())  # a broadcast, a clipped update

    def begin_segment(self, first_step: int, steps: int) -> None:
        """Asynchronous schedules: the next `run(self.actions)` trains minibatches [first_step, first_step + steps) as
        one list that fills and drains (stash.py, "Segments"): versions from its start, microbatches in global order."""
        if self.flush:
            raise RuntimeError("segments are for the asynchronous schedules (async, 2bw)")
        self._use_schedule(steps)
        self.mb_offset = first_step * self.m
        self._new_policy()

    def _peer(self, a: Action) -> int:
        """The rank on the other end of a transfer action, cached per (kind, stage, microbatch) of this list."""
        key = (a.kind, a.stage, a.microbatch)
        if key not in self._peers:
            s, r = self.sched.workers[self.sched.peer(self.worker, a)]
            self._peers[key] = self.plan.stages[s].ranks[r]
        return self._peers[key]

    def global_mb(self, step: int, i: int) -> int:
        return step * self.m + i if self.flush else self.mb_offset + i

    def run(self, actions: list[Action], step: int = 0, on_step: Callable[[int], None] | None = None) -> None:
        """Execute `actions`, each on the stage it names. For flush schedules `step` places microbatch i at
        global index step*m+i; `on_step(k)` is called after the k-th STEP of an asynchronous list."""
        Posted = tuple[list[torch.Tensor | None], list[Any]]  # gradients received (None: none came back)
        # Keyed by (model stage, microbatch): a rank holding several chunks has several of each in flight.
        recv_f = ForwardReceives(self.p2p)  # posted ahead where that cannot block the host (receives.py)
        recv_b: dict[tuple[int, int], Posted | None] = {}
        outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        in_grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}  # None: an input the stage did not use
        dead: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # buffers to release
        arm_at, steps_done = arm_points(self.sched, self.worker, actions, self.split), 0  # the last B (W) before STEPs
        self.update.begin(self.global_mb(step, 0) // self.m)  # the list's first minibatch: the lr schedule's place
        self.policy.begin_actions()  # nothing of this list is posted yet (graphs.CaptureAtStep captures here)
        for a in actions:
            if a.kind is Kind.STEP:
                self._step()
                if on_step is not None:
                    on_step(steps_done)
                steps_done += 1
                continue
            i = a.microbatch
            assert i is not None
            k = self.sched.stage_at(self.worker, a)
            stage, key = self.stages[k], (k, i)
            if a.kind is Kind.RECV_F:
                recv_f.ahead(key, self._peer(a), self._signature(k - 1, step, i))
            elif a.kind is Kind.RECV_B:  # ahead once F(i) ran and the peer said which gradients come, in order
                sig = self._signature(k, step, i)
                known = key in outputs and self.p2p.knows(self._peer(a), signature_of(sig))
                known = known and None not in recv_b.values()  # none left for its B posted before this one
                recv_b[key] = recv_grads(self.p2p, self._peer(a), sig) if known else None
            elif a.kind is Kind.F:
                posted = None if stage.first else recv_f.take(key)
                outputs[key] = self._forward(stage, step, a, posted)
            elif a.kind is Kind.SEND_F:
                with self.timer.span("SEND_F", i):
                    self.p2p.send(outputs[key], self._peer(a), "F", signature=self._signature(k, step, i),
                                  tree=stage.trees.pop(i, None))
            elif a.kind is Kind.B:
                posted = recv_b.pop(key, None)
                if posted is None and not stage.last:
                    posted = recv_grads(self.p2p, self._peer(Action(Kind.RECV_B, i, a.stage)),
                                        self._signature(k, step, i))
                reducer = self.reducers.get(k)
                if reducer is not None and self.split is Kind.B and key in arm_at and i in stage.saved:
                    reducer.arm([o for o, g in zip(stage.saved[i].outputs, posted[0]) if g is not None]
                                if posted else stage.saved[i].outputs)  # the outputs a gradient came back for
                in_grads[key] = self._backward(stage, i, posted)
                # Received buffers are dead after B (W, where split), reused unless aliased (comm.P2P.release).
                dead[key] = (self._received.pop(key, []) + [g for g in (posted[0] if posted else []) if g is not None],
                             (outputs.pop(key, None) or []) + [g for g in in_grads[key] if g is not None])
                if self.split is Kind.B:
                    self.p2p.release(*dead.pop(key))
            elif a.kind is Kind.W:
                if self.reducers.get(k) is not None and key in arm_at:
                    self.reducers[k].arm_params(stage.deferred_weights(i))
                with self.timer.span("W", i):
                    stage.backward_weights(i)
                self.p2p.release(*dead.pop(key))
            elif a.kind is Kind.SEND_B:
                with self.timer.span("SEND_B", i):
                    send_grads(self.p2p, in_grads.pop(key), self._peer(a), self._signature(k - 1, step, i))
            else:
                raise RuntimeError(f"rank {self.world.rank}: the engine cannot run action {a}")
        self.p2p.wait_sends()
        if self.p2p.peak_pending > self._logged_peak:
            self._logged_peak = self.p2p.peak_pending
            log.info("sends held: peak %d (%d bytes), window %d", self.p2p.peak_pending,
                     self.p2p.peak_pending_bytes, self.p2p.window)
        if not self.flush:
            self.policy.finish()
            self.update.drain(self.step_gate)  # a segment's end: checkpoints and --save read the weights

    def _signature(self, sender: int, step: int, i: int) -> Any:
        """What the shapes of the activations model stage `sender` sends for microbatch i depend on."""
        sig = self.loader.signature(self.global_mb(step, i))
        return sig if self.v == 1 else (sender, sig)

    def _forward(self, stage: Stage, step: int, a: Action,
                 posted: tuple[list[torch.Tensor], list[Any]] | None) -> list[torch.Tensor]:
        i = a.microbatch
        assert i is not None
        j = self.global_mb(step, i)
        # A stage that is both first and last (data parallelism) reads the microbatch once.
        data = self.loader.microbatch(j) if stage.first or stage.last else None
        target = data[1] if data is not None and stage.last else None
        tree = None  # what surrounds the received tensors (structure.py)
        if posted is None:
            assert data is not None
            inputs: Any = data[0]
        else:
            bufs, works = posted
            with self.timer.span("WAIT_F", i):
                for w in works:
                    w.wait()
            k = self.sched.stage_at(self.worker, a)
            meta, tree = self.p2p.expect_meta(self._peer(Action(Kind.RECV_F, i, a.stage)),
                                              self._signature(k - 1, step, i))
            inputs = mark_requires_grad(bufs, [m[2] for m in meta])
            self._received[(k, i)] = bufs
        self.policy.before_forward(i)
        scale = self.kind.loss_scale(self.m)
        with self.timer.span("F", i):
            outs = stage.forward(i, inputs, target, loss_scale=scale, global_mb=j, tree=tree)
        self.policy.after_forward(i)
        if stage.last:
            self.losses.append(outs[0])
        return outs

    def _backward(self, stage: Stage, i: int, posted: tuple[list[torch.Tensor | None], list[Any]] | None
                  ) -> list[torch.Tensor | None]:
        grads = None
        if posted is not None:
            grads, works = posted
            with self.timer.span("WAIT_B", i):
                for w in works:
                    w.wait()
        self.policy.before_backward(i)
        with self.timer.span("B", i):
            out = stage.backward(i, grads)
        self.policy.after_backward(i)
        return out

    def _step(self) -> None:
        with self.timer.span("STEP"):
            self.update.reduce()
            self.policy.before_step()
            self.update.step(self.step_gate, self.losses[self._step_losses:])  # guard.StepGuard: stop/skip
            self._step_losses = len(self.losses)
            self.policy.after_step()

    def train_step(self, step: int) -> None:
        """One minibatch of a flush schedule: its m microbatches, then the optimizer step."""
        self.run(self.actions, step)

    @property
    def holds_last(self) -> bool:
        """This rank holds the model's last stage (the loss)."""
        return any(c.last for c in self.stages.values())

    def take_loss(self, count: int) -> float | None:
        """Mean loss of the `count` microbatches run since the last call, over the last stage's replicas, on the
        rank that owns the loss (last stage, replica 0), None elsewhere; reads the device (call it to report)."""
        if not self.holds_last:
            return None
        losses, self.losses, self._step_losses = self.losses, [], 0
        return mean_loss(losses, count, self.loss_group, self.world.device, owner=self.r == 0)

    @property
    def owns_loss(self) -> bool:
        return self.holds_last and self.r == 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the model-wide keys of nn.Sequential(*spec.layers) ("3.weight")."""
        if self.shard is not None:  # its exchange, landing under the next forward (shard.py), in place: a local wait
            self.shard.finish()
        return {k: v for c in self.stages.values() for k, v in c.model_state_dict().items()}
