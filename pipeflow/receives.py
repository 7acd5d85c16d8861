"""When the receives of forward inputs are posted: ahead of their F, or at it (the GPU interleaved hang).

The schedule posts each receive one compute action before its use, so that the transfer overlaps that
compute. A receive whose shapes this rank does not know yet cannot be posted without first waiting for them
(P2P.recv reads them over MPI), and that wait blocks this rank's host until the peer's host sends them. If
meanwhile the peer's GPU waits for a receive it posted ahead, one that this rank sends only after that wait
(a first cuBLAS use or a fresh allocation can wait for every kernel queued, posted NCCL receives included),
neither host moves on: on 2 H100s interleaved hung in its first step that way (tests/device_sync.py emulates
such a wait on CPU). So such a receive is posted at its F, where the rank needs its data anyway, and so is
every later one from the same peer until it is: a channel matches its receives in the order they are posted.
Once the shapes are known (from the first step on, unless they change) every receive goes ahead again.
"""
from __future__ import annotations

from typing import Any

Key = tuple[int, int]  # (model stage, microbatch)


class ForwardReceives:
    """The forward-input receives of one action list, over `p2p` (comm.P2P)."""

    def __init__(self, p2p: Any) -> None:
        self.p2p = p2p
        self.posted: dict[Key, Any] = {}
        self.deferred: dict[int, list[Key]] = {}  # peer -> receives to post at their F, in their order
        self.source: dict[Key, tuple[int, Any]] = {}  # a deferred receive's peer and signature

    def ahead(self, key: Key, peer: int, signature: Any) -> None:
        """The RECV_F action: post now if the shapes are known and nothing from `peer` waits for its F."""
        if self.deferred.get(peer) or not self.p2p.knows(peer, signature):
            self.deferred.setdefault(peer, []).append(key)
            self.source[key] = (peer, signature)
        else:
            self.posted[key] = self.p2p.recv(peer, "F", signature=signature)

    def take(self, key: Key) -> Any:
        """At F: the receive posted ahead, or the deferred one posted now (the oldest from its peer)."""
        posted = self.posted.pop(key, None)
        if posted is not None:
            return posted
        if key not in self.source:
            raise RuntimeError(f"the forward of stage {key[0]}, microbatch {key[1]} has no RECV_F before it: "
                               "the action list never receives its input")
        peer, signature = self.source[key]
        queue = self.deferred[peer]
        if queue[0] != key:
            raise RuntimeError(f"the forward of stage {key[0]}, microbatch {key[1]} has no receive from rank {peer} "
                               f"in order (waiting: {queue}): the action list posts receives out of order")
        queue.pop(0)
        del self.source[key]
        return self.p2p.recv(peer, "F", signature=signature)
