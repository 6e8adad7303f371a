"""What `dolmus serve` adds on top of the engine's config (flags map one-to-one)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dolmus.config.fields import check_choices, choice

PRIORITY_TIERS = {"interactive": 0, "batch": 1}


@dataclass
class ServerConfig:
    """What `dolmus serve` adds on top of the engine (flags map one-to-one)."""

    host: str = "127.0.0.1"
    port: int = 8000
    # defaults to a short name of --model (server/model_names.py); the path stays accepted
    served_model_name: str | None = None
    api_key: str | None = None  # also read from DOLMUS_API_KEY
    tiers: str | None = None  # a YAML file of tiers and API keys with quotas (server/access.py)
    chat_template: str | None = None  # a jinja2 file, or the template itself
    # <think>...</think> of reasoning models to `reasoning_content` (server/openai/reasoning.py)
    reasoning_parser: str | None = choice(None, (None, "deepseek_r1", "qwen3"))
    # the format of tool calls in a chat reply under tool_choice "auto" (server/tools/)
    tool_call_parser: str = choice("hermes", ("hermes", "llama3_json", "mistral", "pythonic"))
    max_waiting: int | None = None  # 429 when more sequences than this wait; None: no limit
    max_n: int = 128  # most samples (`n`) one request may ask for, as OpenAI's limit
    # /v1/embeddings' and /api/embed's default pooling of final hidden states (pooling_params.py)
    pooling: str = choice("last", ("last", "mean"))
    max_body_bytes: int = 32 << 20  # 413 above this
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    gpu_hour_cost: float | None = None  # currency per machine-hour, for cost per token
    log_level: str = "info"
    ui: bool = True  # the chat page and dashboard at / (server/ui/)
    # Browser origins allowed to call the API from their pages (CORS); none by default, "*" for
    # any. Preflights are answered before the API-key check (browsers send them without keys).
    allowed_origins: tuple[str, ...] = ()
    # process (the default): the step loop in its own process, so HTTP and SSE work never
    # holds the GIL the step's op dispatch waits for; thread: on a thread of the API server's
    # process (one process, less memory). On 2 cores serving SmolLM2 Q4_1 at one user the
    # split made 77 tok/s against 45 on a thread (benchmarks/gguf_vs_llama_server.py, TPOT
    # 12 vs 21 ms). The thread still wins on the 260k-parameter toy at 128 streams, where
    # three processes share two cores (benchmarks/serve_vs_offline.py: 0.65x of offline
    # against the split's 0.57x with 2 torch threads; 0.54x against 0.60x with 1).
    engine_core: str = choice("process", ("thread", "process"))
    # Data parallelism: this many engine cores (each a model copy pinned to its share of the
    # host's cores or GPUs) behind this one API port; requests placed by cached prefix, then load.
    data_parallel_size: int = 1
    # Files and jobs of the Batch API (server/openai/batches.py); None: a temporary folder
    # removed at exit, so unfinished jobs do not survive a restart.
    batch_dir: str | None = None

    @property
    def one_core_process(self) -> bool:
        """The engine runs as one core process (not on a thread, not as replicas)."""
        return self.engine_core == "process" and self.data_parallel_size == 1

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.engine_core != "process":
            raise ValueError("data_parallel_size > 1 runs replicas as processes: engine_core must be process")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.gpu_hour_cost is not None and self.gpu_hour_cost < 0:
            raise ValueError(f"gpu_hour_cost must be >= 0, got {self.gpu_hour_cost}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], or *)")
        check_choices(self)

    def load_chat_template(self) -> str | None:
        """The --chat-template value as template text: a file's contents, or the text itself."""
        value = self.chat_template
        if value is None:
            return None
        path = Path(value)
        if path.is_file():
            return path.read_text()
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"chat_template: {value!r} is neither a file nor a jinja2 template")
