"""Who may call the server, in which tier, and how much: API keys, tiers and quotas.

A tiers file (`dolmus serve --tiers FILE`, YAML) names the tiers and the keys:

    tiers:
      interactive:
        priority: 0
        ttft_target: 0.5          # seconds; what the SLO metrics count against (optional)
        tpot_target: 0.05
        reserved_seats: 0.25      # shares of max_num_seqs, KV blocks and each step's tokens
        reserved_kv: 0.25         # held for this tier; others borrow them while it is idle
        reserved_tokens: 0.25
        max_queue_wait: 10        # seconds before its first step, then 429 (optional)
        admission: refuse         # serve | refuse | demote a request the TTFT target cannot meet
      batch: {priority: 1}
    keys:
      - key: sk-team-a            # or key_env: TEAM_A_KEY (read from the environment)
        tier: interactive
        app: team-a               # shown in logs and per-key metrics
        requests_per_minute: 60
        tokens_per_minute: 50000  # prompt tokens + max_tokens asked, unused ones given back
      - key: sk-nightly
        tier: batch

A tiers-file key's tier is the most urgent its requests may run in: `X-Priority` (or a body `priority`)
can ask for a less urgent tier, never a more urgent one. Quotas are token buckets (the
whole minute's allowance may be spent at once, and it refills evenly over the minute); a
request over its key's quota gets 429 with `Retry-After` saying when it would pass, and a
request larger than a whole minute's allowance gets 400, since waiting would not help.
Without a tiers file, `--api-key` is one key with no quota, and no key means an open server.

The scheduling fields go to the engine as `TierSpec`s (dolmus/config/; engine/tier_book.py and
engine/admission.py say what they do). A tier's TTFT and TPOT targets are what its SLO metrics count against
(`dolmus:tier_slo_met_total`); a request whose priority names no tier is counted in the
most urgent tier at least as lax as it (so the label set stays the tiers file's).
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dolmus.config import EngineConfig, TierSpec, check_tiers
from dolmus.config.server import PRIORITY_TIERS


class TokenBucket:
    """`per_minute` units, all available at once, refilled at per_minute / 60 per second."""

    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0
        self.level = self.capacity
        self.clock = clock
        self.stamp = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` would be available (0: available now); takes nothing."""
        with self._lock:
            self._refill()
            return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self.level -= amount

    def give_back(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int  # lower runs first
    ttft_target: float | None = None  # seconds
    tpot_target: float | None = None  # seconds
    spec: TierSpec | None = None  # what the scheduler is told: reservations, queue wait, admission

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether a request with these latencies met every target the tier sets."""
        if self.ttft_target is not None and (ttft is None or ttft > self.ttft_target):
            return False
        return self.tpot_target is None or tpot is None or tpot <= self.tpot_target


def _default_tiers() -> dict[str, Tier]:
    return {name: Tier(name, priority) for name, priority in PRIORITY_TIERS.items()}


@dataclass
class Client:
    """A key's holder: its tier and its quotas (None: unlimited)."""

    name: str
    tier: str
    priority: int  # of requests that ask for no tier
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    capped: bool = True  # may not ask for a more urgent priority than its tier's


@dataclass
class AccessPolicy:
    tiers: dict[str, Tier] = field(default_factory=_default_tiers)
    keys: dict[str, Client] = field(default_factory=dict)  # key -> holder
    anonymous: Client | None = None  # who a request without a key is; None: a key is required

    @classmethod
    def build(cls, tiers_file: str | None, api_key: str | None) -> AccessPolicy:
        if tiers_file is not None:
            if api_key:
                raise ValueError("tiers: give keys in the tiers file or --api-key, not both")
            return cls.from_file(tiers_file)
        most_urgent = min(PRIORITY_TIERS, key=PRIORITY_TIERS.__getitem__)
        holder = Client("default", most_urgent, PRIORITY_TIERS[most_urgent], capped=False)
        if api_key:
            return cls(keys={api_key: holder})
        return cls(anonymous=holder)

    @classmethod
    def from_file(cls, path: str | Path) -> AccessPolicy:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"tiers: cannot read {str(path)!r}: {exc}") from exc
        return cls.from_dict(raw if raw is not None else {})

    @classmethod
    def from_dict(cls, raw: Any) -> AccessPolicy:
        if not isinstance(raw, dict) or not set(raw) <= {"tiers", "keys"}:
            raise ValueError("tiers: the file holds a mapping with `tiers` and `keys`")
        tiers = parse_tiers(raw.get("tiers") or dict(PRIORITY_TIERS))
        keys: dict[str, Client] = {}
        for i, entry in enumerate(raw.get("keys") or []):
            key, client = _parse_key(entry, i, tiers)
            if key in keys:
                raise ValueError(f"tiers: keys[{i}] repeats a key")
            keys[key] = client
        # With no keys the server is open, in the most urgent tier, as without a file.
        anonymous = None
        if not keys:
            first = min(tiers.values(), key=lambda t: t.priority)
            anonymous = Client("default", first.name, first.priority, capped=False)
        return cls(tiers, keys, anonymous)

    @property
    def needs_key(self) -> bool:
        return self.anonymous is None

    def identify(self, authorization: str | None) -> Client | None:
        """The holder of the bearer key in an Authorization header; None if it is not ours."""
        if self.anonymous is not None:
            return self.anonymous
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for key, client in self.keys.items():  # compare with every key: no timing hint
            if hmac.compare_digest(given, key.encode()):
                found = client
        return found

    def priority_for(self, client: Client, asked: int | str | None) -> int:
        """The scheduler priority of a request: what it asked for, never above its key's tier.

        `asked` is a tier name (X-Priority), a number (the body's `priority`) or None.
        """
        if asked is None:
            return client.priority
        if isinstance(asked, str):
            name = asked.strip().lower()
            if name not in self.tiers:
                raise ValueError(f"X-Priority must be one of {', '.join(self.tiers)}, got {asked!r}")
            asked = self.tiers[name].priority
        return max(asked, client.priority) if client.capped else asked

    def engine_tiers(self) -> tuple[TierSpec, ...]:
        return scheduling_specs(self.tiers)

    def engine_config_for(self, config: EngineConfig) -> EngineConfig:
        """The engine config with the tiers file's reservations and rules for the scheduler
        (kept where the config names tiers of its own)."""
        return config if config.tier_specs else dataclasses.replace(config, tier_specs=self.engine_tiers())

    def tier_of(self, priority: int) -> Tier:
        """The tier a request of this priority is counted in: the most urgent one at least as
        lax as it, or the most urgent tier of all when it is more urgent than every one."""
        ordered = sorted(self.tiers.values(), key=lambda t: t.priority)
        found = ordered[0]
        for tier in ordered:
            if tier.priority <= priority:
                found = tier
        return found


def scheduling_specs(tiers: dict[str, Tier]) -> tuple[TierSpec, ...]:
    """The tiers as the engine schedules them; none when no tier asks for anything."""
    specs = tuple(t.spec for t in tiers.values() if t.spec is not None)
    return specs if any(s != TierSpec(s.priority) for s in specs) else ()


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


_SCHEDULING_FIELDS = ("reserved_seats", "reserved_kv", "reserved_tokens", "max_queue_wait", "admission")


def parse_tiers(raw: Any) -> dict[str, Tier]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            "tiers: `tiers` maps each tier's name to its settings, e.g. {interactive: {priority: 0}}"
        )
    tiers = {}
    for name, spec in raw.items():
        spec = spec if isinstance(spec, dict) else {"priority": spec}
        unknown = set(spec) - {"priority", "ttft_target", "tpot_target", *_SCHEDULING_FIELDS}
        if unknown:
            raise ValueError(f"tiers: tier {name!r} has unknown fields: {', '.join(sorted(unknown))}")
        priority = spec.get("priority")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"tiers: tier {name!r} needs an integer priority (lower runs first)")
        targets = []
        for key in ("ttft_target", "tpot_target", "max_queue_wait"):
            value = spec.get(key)
            if value is not None and not _is_positive_number(value):
                raise ValueError(f"tiers: tier {name!r}: {key} must be a positive number of seconds")
            targets.append(float(value) if value is not None else None)
        shares = []
        for key in ("reserved_seats", "reserved_kv", "reserved_tokens"):
            value = spec.get(key, 0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"tiers: tier {name!r}: {key} is a share in [0, 1), got {value!r}")
            shares.append(float(value))
        try:
            admission = str(spec.get("admission", "serve"))
            engine_spec = TierSpec(priority, *shares, targets[2], targets[0], admission)
        except ValueError as exc:
            raise ValueError(f"tiers: tier {name!r}: {exc}") from exc
        tiers[str(name).lower()] = Tier(str(name).lower(), priority, targets[0], targets[1], engine_spec)
    check_tiers(tuple(t.spec for t in tiers.values() if t.spec is not None))
    return tiers


def _parse_key(entry: Any, i: int, tiers: dict[str, Tier]) -> tuple[str, Client]:
    where = f"tiers: keys[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping with key (or key_env) and tier")
    unknown = set(entry) - {"key", "key_env", "tier", "app", "requests_per_minute", "tokens_per_minute"}
    if unknown:
        raise ValueError(f"{where} has unknown fields: {', '.join(sorted(unknown))}")
    if ("key" in entry) == ("key_env" in entry):
        raise ValueError(f"{where} needs exactly one of key and key_env")
    key = entry.get("key") or os.environ.get(str(entry["key_env"]), "")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: the key is empty (is {entry.get('key_env')} set?)")
    tier = str(entry.get("tier", "")).lower()
    if tier not in tiers:
        raise ValueError(f"{where}: tier must be one of {', '.join(tiers)}, got {entry.get('tier')!r}")
    buckets = []
    for name in ("requests_per_minute", "tokens_per_minute"):
        limit = entry.get(name)
        if limit is not None and not _is_positive_number(limit):
            raise ValueError(f"{where}: {name} must be a positive number")
        buckets.append(TokenBucket(limit) if limit is not None else None)
    app = str(entry.get("app") or f"key{i}")
    return key, Client(app, tier, tiers[tier].priority, *buckets)


class QuotaExceeded(Exception):
    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # None: waiting will not help

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after or 0)))


def charge(client: Client, tokens: int) -> None:
    """Take one request and `tokens` from the client's quotas, or raise QuotaExceeded."""
    if client.tokens is not None and tokens > client.tokens.capacity:
        raise QuotaExceeded(
            f"this request needs {tokens} tokens (prompt + max_tokens), more than the key's "
            f"quota of {client.tokens.capacity:.0f} tokens per minute",
            None,
        )
    waits = []
    if client.requests is not None and (w := client.requests.wait_for(1)) > 0:
        waits.append((w, f"{client.requests.capacity:.0f} requests per minute"))
    if client.tokens is not None and (w := client.tokens.wait_for(tokens)) > 0:
        waits.append((w, f"{client.tokens.capacity:.0f} tokens per minute"))
    if waits:
        wait, what = max(waits)
        raise QuotaExceeded(f"over the key's quota of {what}: retry in {math.ceil(wait)} s", wait)
    if client.requests is not None:
        client.requests.take(1)
    if client.tokens is not None:
        client.tokens.take(tokens)
