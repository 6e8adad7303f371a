"""The control channel between the engine and its rank processes: ZeroMQ, one socket each.

The engine binds a ROUTER socket; every rank (and, on hosts past the first, the node process
that starts them) connects a DEALER named for itself, so plans go to each rank by name and
answers come back with the sender's name. Ranks on the engine's host connect over an ipc
socket; ranks on other hosts over TCP on `master_port + 1`, with ZeroMQ heartbeats so a host
that vanishes without closing its connection is noticed within seconds. Messages are
(kind, payload) frames; payloads are msgpack (plans, results) or pickle (start-up facts,
between processes of one deployment only).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq

HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000  # a peer silent this long is disconnected (and so declared dead)


def rank_name(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def node_name(node_rank: int) -> bytes:
    return f"node-{node_rank}".encode()


def control_port(master_port: int) -> int:
    """The engine's control channel listens next to torch.distributed's rendezvous port."""
    return master_port + 1


def with_heartbeats(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    return sock


def connect_dealer(ctx: zmq.Context, name: bytes, address: str) -> zmq.Socket:
    sock = with_heartbeats(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.IDENTITY, name)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def digest(answer: bytes) -> bytes:
    """What a rank past 0 returns for a step: every rank samples the same tokens from the same
    gathered logits, and the engine checks that they did."""
    return hashlib.blake2b(answer, digest_size=16).digest()


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank sits and how it reaches the others: plain data for its process."""

    rank: int
    world_size: int
    local_rank: int  # its index among the ranks on its host
    local_ranks: int  # ranks on its host
    control_address: str  # the engine's ROUTER socket
    master_addr: str  # torch.distributed's rendezvous (rank 0's host)
    master_port: int
    timeout_s: float  # a collective that waits longer raises
