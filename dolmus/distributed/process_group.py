"""Joining the tensor-parallel process group: torch.distributed's env:// rendezvous.

Each rank process sets the variables torchrun sets (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK) and calls `init_process_group`, so the same code joins ranks on one
host or on several. Gloo carries the collectives on CPU; NCCL on CUDA, with a gloo group
beside it for host-side values. Every collective has the engine's distributed timeout: a
rank whose peer is gone raises instead of waiting forever. CPU ranks that all share one host
exchange their layers' partial results through shared memory (shm_collectives.py).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from dolmus.distributed.collectives import use_shared_memory
from dolmus.distributed.shm_collectives import ShmCollectives

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def interface_toward(address: str) -> str | None:
    """The name of this host's network interface that reaches `address` (None: loopback or
    unknown). Gloo otherwise picks an interface from the host name, which in a container or a
    network namespace often resolves to one the other hosts cannot reach."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(address)).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: no packet is sent, the kernel only picks a route
            local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                except OSError:
                    continue
            if addr == local:
                return name
    except OSError:
        pass
    return None


def join_process_group(
    rank: int,
    world_size: int,
    local_rank: int,
    local_ranks: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_s: float,
) -> None:
    """Join the group as `rank` of `world_size` (rank 0 hosts the rendezvous store)."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
    )
    interface = interface_toward(master_addr)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    through_memory = local_ranks == world_size and device.type == "cpu"  # every rank on this host
    if through_memory:
        use_shared_memory(ShmCollectives(rank, world_size, timeout_s))
    logger.debug(
        "rank %d/%d joined over %s (%s)%s",
        rank,
        world_size,
        backend,
        interface or "loopback",
        ", collectives through shared memory" if through_memory else "",
    )


def leave_process_group() -> None:
    use_shared_memory(None)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pin_to_cores(local_rank: int, local_ranks: int) -> None:
    """Give a CPU rank its own contiguous share of this host's cores (its threads then never
    compete with another rank's; a collective waits for the slowest rank)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return
    share = len(cores) // local_ranks
    if share < 1:
        return
    os.sched_setaffinity(0, cores[local_rank * share : (local_rank + 1) * share])
