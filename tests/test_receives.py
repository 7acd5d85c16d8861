"""pipeflow/receives.py: when forward-input receives are posted (ahead, or at their F) and in which order."""
from __future__ import annotations

from typing import Any

import pytest

from pipeflow.receives import ForwardReceives


class FakeP2P:
    """Records the receives posted; `known` is the (peer, signature) pairs whose shapes are cached."""

    def __init__(self, known: set[tuple[int, Any]]) -> None:
        self.known, self.log = known, []

    def knows(self, src: int, signature: Any) -> bool:
        return (src, signature) in self.known

    def recv(self, src: int, direction: str, *, signature: Any = None) -> str:
        self.known.add((src, signature))  # P2P.recv caches the shapes it waited for
        self.log.append((src, signature))
        return f"posted {src} {signature}"


def test_known_shapes_post_ahead():
    p2p = FakeP2P({(0, "s")})
    r = ForwardReceives(p2p)
    r.ahead((1, 0), 0, "s")
    assert p2p.log == [(0, "s")]
    assert r.take((1, 0)) == "posted 0 s" and p2p.log == [(0, "s")]


def test_unknown_shapes_wait_for_the_forward_and_later_receives_from_that_peer_keep_their_order():
    """The first step of interleaved on 2 ranks (rank 1): chunk 1's inputs from rank 0 with unknown shapes, then,
    once they are known, chunk 1's next input, while chunk 3's (other shapes, unknown) still waits: posting
    chunk 1's ahead of chunk 3's would swap the two on the channel."""
    p2p = FakeP2P(set())
    r = ForwardReceives(p2p)
    r.ahead((1, 0), 0, "c0")
    r.ahead((1, 1), 0, "c0")
    assert p2p.log == []                       # not ahead: the shapes would block the host
    r.take((1, 0))
    r.take((1, 1))
    r.ahead((3, 0), 0, "c2")                   # unknown: deferred
    r.ahead((1, 2), 0, "c0")                   # known, but behind a deferred one from the same peer
    r.ahead((5, 0), 4, "c4")                   # another peer is a channel of its own: unknown, deferred
    assert p2p.log == [(0, "c0"), (0, "c0")]
    r.take((3, 0))
    r.take((1, 2))
    assert p2p.log == [(0, "c0"), (0, "c0"), (0, "c2"), (0, "c0")]
    r.ahead((1, 3), 0, "c0")                   # nothing waits any more: ahead again
    assert p2p.log[-1] == (0, "c0") and len(p2p.log) == 5


def test_a_forward_out_of_the_channels_order_is_an_error_naming_it():
    r = ForwardReceives(FakeP2P(set()))
    r.ahead((1, 0), 0, "s")
    r.ahead((1, 1), 0, "s")
    with pytest.raises(RuntimeError, match=r"^the forward of stage 1, microbatch 1 has no receive from rank 0 in "
                                           r"order \(waiting: \[\(1, 0\), \(1, 1\)\]\)"):
        r.take((1, 1))


def test_a_forward_without_a_receive_before_it_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match=r"^the forward of stage 2, microbatch 0 has no RECV_F before it"):
        ForwardReceives(FakeP2P(set())).take((2, 0))
