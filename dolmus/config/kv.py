"""The KV cache's connections outside the engine, with vLLM's keys and defaults: events for
cache-aware routers (`kv_events_config`), transfers between prefill and decode workers
(`kv_transfer_config`) and the offload tier (`kv_offload`). EngineConfig (config/__init__.py) holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from dolmus.config.fields import from_known_keys

KV_EVENT_PUBLISHERS = ("null", "zmq")


def _check_zmq_address(name: str, value: Any) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ValueError(
            f"kv_events_config: {name} must be a ZMQ address (tcp://host:port, ipc://path), got {value!r}"
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events for cache-aware routers, with vLLM's keys and defaults
    (`kv_events_config={"enable_kv_cache_events": true, ...}`): the stream itself is
    engine/kv_events.py's. The default endpoint binds every interface, as vLLM's does, and the
    events carry prompt token ids: give an address only the router can reach."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # null | zmq; None: zmq when enabled, else null (as vLLM)
    endpoint: str = "tcp://*:5557"  # PUB socket: binds for a wildcard host or ipc://, else connects
    replay_endpoint: str | None = None  # ROUTER socket (always binds) serving missed batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket (messages per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""
    # Ours, not vLLM's: whether the PUB socket binds `endpoint` (true) or connects to it (false).
    # None keeps vLLM's rule (a wildcard host or ipc:// binds). A router that connects to its
    # sources (vllm-router's --kv-event-source) needs a bound publisher; true binds a loopback
    # address such as tcp://127.0.0.1:5557, where vLLM's rule would only bind every interface.
    bind: bool | None = None

    def __post_init__(self) -> None:
        for name, kind in (("enable_kv_cache_events", bool), ("endpoint", str), ("topic", str)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(f"kv_events_config: {name} must be a {kind.__name__}, got {value!r}")
        if self.bind is not None and not isinstance(self.bind, bool):
            raise ValueError(f"kv_events_config: bind must be true, false or null, got {self.bind!r}")
        for name, least in (("buffer_steps", 0), ("hwm", 1), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv_events_config: {name} must be an integer >= {least}, got {value!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(
                f"kv_events_config: publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        if self.publishes:
            _check_zmq_address("endpoint", self.endpoint)
            if self.replay_endpoint is not None:
                _check_zmq_address("replay_endpoint", self.replay_endpoint)

    @property
    def publishes(self) -> bool:
        """Whether events leave the engine at all (enabled, with a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVEventsConfig:
        return from_known_keys(cls, raw, "kv_events_config")


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# our TCP transport, or Mooncake Store (vLLM's name for that connector) as the transfer medium
KV_CONNECTORS = ("DolmusConnector", "MooncakeStoreConnector")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode, with vLLM's keys (`kv_transfer_config={"kv_role": ...}`).

    A producer (prefill worker) keeps the KV of prompts asked for a remote decode in a bounded
    outbox (`kv_buffer_size` bytes): with DolmusConnector rank r serves it on `kv_port + r` and
    `kv_ip` is the address peers are told to reach; with MooncakeStoreConnector the outbox is
    the Mooncake store at `kv_connector_extra_config["master_server_address"]` (HOST:PORT), to
    which the producer lends the bytes. A consumer (decode worker) fetches from what the prefill
    response's `kv_transfer_params` name."""

    kv_connector: str = "DolmusConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # bytes of outbox (the producer side)
    # fail: a request whose remote KV cannot be fetched ends with an error naming the peer;
    # recompute: it computes its prompt itself
    kv_load_failure_policy: str = "fail"
    kv_transfer_timeout: float = 30.0  # seconds a fetch may take before the peer counts as gone
    engine_id: str | None = None  # named in kv_transfer_params; None: a random one
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: kv_connector {self.kv_connector!r} is not available here; "
                f"one of {', '.join(KV_CONNECTORS)} (behind vLLM's kv_transfer_params either way)"
            )
        if self.kv_connector == "MooncakeStoreConnector" and self.mooncake_master is None:
            raise ValueError(
                "kv_transfer_config: MooncakeStoreConnector needs kv_connector_extra_config "
                '{"master_server_address": "HOST:PORT"}'
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                "kv_transfer_config: kv_load_failure_policy must be one of "
                + ", ".join(KV_LOAD_FAILURE_POLICIES)
            )
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be a TCP port, got {self.kv_port!r}")
        if self.kv_buffer_size <= 0 or self.kv_transfer_timeout <= 0:
            raise ValueError("kv_transfer_config: kv_buffer_size and kv_transfer_timeout must be positive")

    @property
    def mooncake_master(self) -> str | None:
        """HOST:PORT of the Mooncake master the transfer goes through (None: our TCP transport)."""
        if self.kv_connector != "MooncakeStoreConnector":
            return None
        master = self.kv_connector_extra_config.get("master_server_address")
        host, _, port = str(master or "").rpartition(":")
        return f"{host}:{int(port)}" if host and port.isdigit() else None

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        return from_known_keys(cls, raw, "kv_transfer_config")


class OffloadTier(NamedTuple):
    """A parsed `kv_offload`: the kind, and where (a disk tier's folder, a shared store's master)."""

    kind: str  # cpu | disk | mooncake
    path: Path | None = None  # disk
    master: str | None = None  # mooncake: HOST:PORT of the Mooncake master


def parse_kv_offload(value: str | None) -> OffloadTier | None:
    """`cpu`, `disk:PATH` or `mooncake:HOST:PORT`; None: no offload tier."""
    if value is None:
        return None
    if value == "cpu":
        return OffloadTier("cpu")
    if value.startswith("disk:") and len(value) > len("disk:"):
        return OffloadTier("disk", path=Path(value[len("disk:") :]).expanduser())
    if value.startswith("mooncake:"):
        host, _, port = value[len("mooncake:") :].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return OffloadTier("mooncake", master=f"{host}:{int(port)}")
    raise ValueError(f"kv_offload must be cpu, disk:PATH or mooncake:HOST:PORT, got {value!r}")
