"""One settings model for the router service, fed by flags, ``KVROUTE_*`` env and YAML.

Precedence, highest first: command-line flags (passed as keyword arguments), environment
variables (``KVROUTE_POLICY=lbgr``, ``KVROUTE_WORKER_URLS=http://a:30001,http://b:30002``),
the YAML file given with ``--config`` / ``KVROUTE_CONFIG``, then the defaults below.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from models.persistence import MIN_KEY_BYTES
from router_service.redis_client import parse_redis_url, redact_redis_url

__all__ = ["Settings", "SettingsError", "load_settings", "normalize_worker_url"]


# Ports a worker is never registered on unless configured at start-up: well-known services
# that are not LLM engines (ssh, smtp, dns, etcd, MySQL, PostgreSQL, Redis, Elasticsearch,
# memcached, MongoDB), reachable on loopback but not something to proxy prompts to.
_REFUSED_PORTS = frozenset({22, 23, 25, 53, 2375, 2379, 2380, 3306, 5432, 6379, 9200, 11211, 27017})


class SettingsError(ValueError):
    """The configuration is invalid; the message names the setting and the fix."""


def normalize_worker_url(url: str) -> str:
    """``http://host[:port]`` or ``https://...`` with no trailing slash (no port: the
    scheme's, 80 or 443); anything else is refused.

    The URL ends up in headers, metrics labels and logs, so control characters and spaces
    are refused too, and credentials are never repeated back in the message.
    """
    text = url.strip().rstrip("/")
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise ValueError("worker URL must not contain spaces or control characters")
    parts = urlsplit(text)
    if parts.username is not None or parts.password is not None:
        raise ValueError("worker URL must not carry credentials (user:password@)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"worker URL must look like http://host:port (or https://; without a port, 80 or "
            f"443), got {url!r}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"worker URL must not carry a query or fragment: {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"worker URL needs a port in 1..65535, got {url!r}")
    return text


class Settings(BaseSettings):
    """Everything ``kvroute serve`` can be told."""

    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # The control plane (/workers, /policy, /models) and /metrics listen here, apart from the
    # data plane; the control plane needs admin_token and is off without one.
    control_host: str = "127.0.0.1"
    # None: the data port + 1 (8001 by default), or a free port when the data port is 0.
    control_port: int | None = Field(None, ge=0, le=65535)
    # Client-facing answers (X-KVRoute-Worker, /explain and /health on the data port, error
    # messages) name workers by label (w0, w1, ...) unless this is set.
    expose_worker_urls: bool = False
    worker_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    policy: str = "lbgr"
    policy_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None  # lbgr's residual model; None: the policy's default (ratio)
    model_sharing: str = "per_worker"
    redis_url: str | None = None
    cluster: str = "default"  # namespaces shared state in Redis
    redis_timeout_ms: float = Field(50.0, gt=0)
    # With redis_url: reads come from a local mirror of the shared loads and writes go to
    # Redis in batches at most this many ms apart (0: one round trip per read, reserve, release).
    load_sync_ms: float = Field(5.0, ge=0, le=1000)
    index_sync: bool = True  # with redis_url: share the prefix index between replicas
    index_block_units: int = Field(16, ge=1, le=4096)
    admin_token: SecretStr | None = None
    replica_id: str | None = None
    health_interval_s: float = Field(5.0, gt=0)
    # Read each worker's /metrics this often for the load this router did not send (other
    # replicas, direct clients); 0: never (router_service.worker_metrics).
    worker_metrics_s: float = Field(1.0, ge=0)
    health_timeout_s: float = Field(2.0, gt=0)
    unhealthy_after_failures: int = Field(2, ge=1)
    healthy_after_successes: int = Field(1, ge=1)
    connect_timeout_s: float = Field(5.0, gt=0)
    first_byte_timeout_s: float = Field(600.0, gt=0)  # until the worker's status line
    request_timeout_s: float = Field(600.0, gt=0)
    retry_max_attempts: int = Field(3, ge=1, le=10)
    retry_backoff_ms: float = Field(50.0, ge=0)
    retry_deadline_s: float = Field(30.0, gt=0)
    breaker_failures: int = Field(10, ge=1)
    breaker_successes: int = Field(3, ge=1)
    breaker_open_s: float = Field(10.0, gt=0)
    # A half-open circuit's trial slot frees when its request ends, or after this long.
    breaker_trial_timeout_s: float = Field(30.0, gt=0)
    # Requests in flight per replica: past it 503 + Retry-After. None: per_worker_in_flight x
    # the registered workers; 0: no cap.
    max_in_flight: int | None = Field(None, ge=0)
    per_worker_in_flight: int = Field(256, ge=1)
    # The hold queue (router_service.dispatch): at most this many of this replica's requests
    # in flight per worker, the rest wait in the router (0: off, route at arrival).
    queue_slots: int = Field(0, ge=0, le=1024)
    queue_max_wait_s: float = Field(20.0, gt=0)  # then a waiting request goes to any worker
    queue_window: int = Field(64, ge=1, le=4096)  # waiting requests considered per pass
    queue_bind_ratio: float = Field(0.25, gt=0, le=1)  # cached share that binds to a worker
    # "first_token": a streamed request frees its slot at its first chunk (decode does not
    # count); "end": when the response ends (best for short outputs, see docs/operations.md);
    # "last_token": like "end", but one decode step before it (the hand-over overlaps it).
    queue_free_at: Literal["first_token", "last_token", "end"] = "first_token"
    rate_limit_rps: float = Field(0.0, ge=0)  # per client; 0: no limit
    rate_limit_burst: int = Field(0, ge=0)
    # POST /explain and GET /explain/{id} per client without the admin token (a probe of what
    # the workers cache); 0: no limit.
    explain_rate_limit_rps: float = Field(5.0, ge=0)
    # Clients are told apart by their address; behind these proxies (networks), by the
    # X-Forwarded-For hop the nearest untrusted party added.
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Request bodies the router holds at once, all requests together: past it 503.
    max_body_bytes_in_flight: int = Field(256 * 1024 * 1024, ge=0)
    # Slow clients: the request head must arrive within header_timeout_s of the connection's
    # first byte (or of its opening), the body within body_timeout_s; heads over
    # max_header_bytes or max_headers fields get 431; connections past max_connections 503.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_headers: int = Field(100, ge=8)
    max_connections: int = Field(4096, ge=16)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    explain_buffer: int = Field(10_000, ge=1)
    model_snapshot_path: Path | None = None
    model_snapshot_interval_s: float = Field(60.0, gt=0)
    # Signs model snapshots (a file, and Redis); a dedicated secret, not the admin token.
    # Without it no snapshot is read or written: a path given without a key is refused.
    model_snapshot_key: SecretStr | None = None
    model_snapshot_key_file: Path | None = None
    # For emulated workers running X times faster than real time: the router's load decay
    # and the latencies it learns from run on the same emulated clock (embedded store only).
    time_scale: float = Field(1.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)  # SIGTERM: let requests in flight finish
    # SIGTERM: keep serving (with /health 503 "draining") this long before closing the listener,
    # so a balancer polling /health sees the drain and stops sending; 0 closes it at once.
    drain_grace_s: float = Field(0.0, ge=0)
    log_prompts: bool = False  # prompt text never reaches the logs unless this is set
    # POST /workers only accepts workers on these networks (IP literals) or these host names,
    # so the control plane cannot be used to make the router reach arbitrary hosts. The hosts
    # of --worker-urls are always allowed.
    allowed_worker_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"]
    )
    allowed_worker_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["localhost"]
    )
    log_level: str = "info"
    # Workers' KV events (SGLang's ZMQ publisher, router_service.kv_events):
    # "URL=tcp://host:port" or "URL=tcp://host:port,tcp://host:replay_port", one per worker.
    worker_kv_events: Annotated[list[str], NoDecode] = Field(default_factory=list)
    kv_events_stale_s: float = Field(30.0, gt=0)  # events this late after an answer: stale
    kv_events_replay_timeout_s: float = Field(5.0, gt=0)
    kv_events_max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # Subscribe to what each worker without configured endpoints names in its /server_info
    # (SGLang's kv_events descriptor), asked every kv_events_discover_s (EventDiscovery).
    kv_events_discover: bool = False
    kv_events_discover_s: float = Field(10.0, gt=0)
    # A local Hugging Face tokenizer directory: route on token ids (router_service.tokenizer).
    tokenizer: Path | None = None
    # Workers from DNS (router_service.discovery): http://NAME:PORT, a headless Service's name;
    # every address NAME resolves to is a worker at PORT, looked up every interval. They pass
    # the allow-list like POST /workers (allowed_worker_networks: the pods' network).
    worker_dns: str | None = None
    worker_dns_interval_s: float = Field(5.0, gt=0)
    # The discovered workers' KV events, * standing for a worker's address:
    # "tcp://*:5557,tcp://*:5558" (the ports of SGLang's --kv-events-config).
    worker_dns_kv_events: str | None = None

    @field_validator("cluster")
    @classmethod
    def _check_cluster(cls, value: str) -> str:
        if not value.strip() or "{" in value or "}" in value:
            raise ValueError(
                "cluster must be a non-empty name without braces: shared keys are "
                "kvroute:{cluster}:..., the braces a Redis Cluster hash tag"
            )
        return value

    @field_validator("worker_dns")
    @classmethod
    def _check_worker_dns(cls, value: str | None) -> str | None:
        if value is None:
            return None
        url = normalize_worker_url(value)
        if urlsplit(url).port is None:
            raise ValueError(f"worker_dns needs the workers' port: http://NAME:PORT, got {value!r}")
        return url

    @model_validator(mode="after")
    def _check_worker_dns_events(self) -> Settings:
        template = self.worker_dns_kv_events
        if template is None:
            return self
        if self.worker_dns is None:
            raise ValueError("worker_dns_kv_events needs worker_dns")
        from router_service.kv_events import parse_source

        if "*" not in template:
            raise ValueError(
                "worker_dns_kv_events: write * for the worker's address, e.g. "
                "tcp://*:5557,tcp://*:5558"
            )
        try:
            parse_source(template.replace("*", "127.0.0.1"))
        except ValueError as exc:
            raise ValueError(f"worker_dns_kv_events: {exc}") from None
        return self

    @field_validator("worker_kv_events", mode="before")
    @classmethod
    def _split_events(cls, value: Any) -> Any:
        if isinstance(value, str):  # env: whitespace-separated (a comma joins the replay)
            return value.split()
        return value

    @model_validator(mode="after")
    def _check_kv_events(self) -> Settings:
        from router_service.kv_events import parse_worker_events

        entries = []
        try:
            for item in self.worker_kv_events:
                url, _, source = item.partition("=")
                entries.append(f"{normalize_worker_url(url)}={source}")
            sources = parse_worker_events(entries)
        except ValueError as exc:
            raise ValueError(f"worker_kv_events: {exc}") from None
        for url in sources:
            if url not in self.worker_urls:
                raise ValueError(f"worker_kv_events: {url} is not one of worker_urls")
        object.__setattr__(self, "worker_kv_events", entries)  # frozen: URLs normalised
        return self

    @field_validator("worker_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [u for u in value.replace(",", " ").split() if u]
        return value

    @field_validator(
        "allowed_worker_networks", "allowed_worker_hosts", "trusted_proxies", mode="before"
    )
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [u for u in value.replace(",", " ").split() if u]
        return value

    @field_validator("allowed_worker_networks", "trusted_proxies")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"not a network: {net!r} (use CIDR, e.g. 10.0.0.0/8)") from None
        return value

    def worker_allowed(self, url: str, refused_ports: Collection[int] = ()) -> bool:
        """Whether POST /workers (or the shared index stream) may register ``url`` (a
        normalized worker URL): a configured worker always; otherwise its host must be
        allowed by name or network, and its port must not be one of the router's own
        listeners, Redis's, or a well-known non-HTTP service's (``_REFUSED_PORTS``)."""
        if url in self.worker_urls:
            return True
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if port in self._refused_ports() or port in refused_ports:
            return False
        configured = {(urlsplit(u).hostname or "").lower() for u in self.worker_urls}
        if host in configured or host in {h.lower() for h in self.allowed_worker_hosts}:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name not allowed by name: never resolved (no DNS rebinding)
        return any(
            address in ipaddress.ip_network(n, strict=False) for n in self.allowed_worker_networks
        )

    def _refused_ports(self) -> set[int]:
        ports = set(_REFUSED_PORTS)
        ports.update(p for p in (self.port, self.control_port_to_bind) if p)
        if self.redis_url:
            ports.update(parse_redis_url(self.redis_url).ports)
        return ports

    def accepted_worker(self, url: str, refused_ports: Collection[int] = ()) -> str | None:
        """``url`` normalized if a worker may be registered at it, else None."""
        try:
            normalized = normalize_worker_url(url)
        except ValueError:
            return None
        return normalized if self.worker_allowed(normalized, refused_ports) else None

    @field_validator("worker_urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        urls = [normalize_worker_url(u) for u in value]
        if len(set(urls)) != len(urls):
            raise ValueError("worker URLs must be unique")
        return urls

    @field_validator("model_sharing")
    @classmethod
    def _check_sharing(cls, value: str) -> str:
        if value not in ("per_worker", "shared"):
            raise ValueError("model_sharing must be per_worker or shared")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis(cls, value: str | None) -> str | None:
        if value is not None:
            parse_redis_url(value)  # one server, a Redis Cluster or Sentinel's; else why not
        return value

    @property
    def control_port_to_bind(self) -> int:
        if self.control_port is not None:
            return self.control_port
        return self.port + 1 if self.port not in (0, 65535) else 0

    @model_validator(mode="after")
    def _check_ports(self) -> Settings:
        if self.port != 0 and self.control_port == self.port:
            raise ValueError(
                f"control_port must differ from port ({self.port}): the control plane listens "
                "on its own port"
            )
        return self

    @model_validator(mode="after")
    def _check_snapshot_key(self) -> Settings:
        if self.model_snapshot_key is not None and self.model_snapshot_key_file is not None:
            raise ValueError("give model_snapshot_key or model_snapshot_key_file, not both")
        key = self.snapshot_key()
        if key is None:
            if self.model_snapshot_path is not None:
                raise ValueError(
                    "model_snapshot_path needs a key to sign and verify snapshots: set "
                    "KVROUTE_MODEL_SNAPSHOT_KEY (or --model-snapshot-key-file) to a secret of "
                    f"at least {MIN_KEY_BYTES} bytes, e.g. the output of "
                    "`python3 -c 'import secrets; print(secrets.token_hex(32))'`"
                )
            return self
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the model snapshot key must be at least {MIN_KEY_BYTES} bytes")
        token = self.admin_token
        if token is not None and key == token.get_secret_value().encode():
            raise ValueError(
                "the model snapshot key must not be the admin token: give each its own secret"
            )
        return self

    def snapshot_key(self) -> bytes | None:
        """The model snapshot key's bytes (from the setting or its file), else None."""
        if self.model_snapshot_key is not None:
            return self.model_snapshot_key.get_secret_value().encode()
        if self.model_snapshot_key_file is not None:
            try:
                return self.model_snapshot_key_file.read_bytes().strip()
            except OSError as exc:
                raise ValueError(
                    f"cannot read model_snapshot_key_file {self.model_snapshot_key_file}: "
                    f"{exc.strerror}"
                ) from None
        return None

    @model_validator(mode="after")
    def _check_time_scale(self) -> Settings:
        if self.time_scale != 1.0 and self.redis_url:
            raise ValueError(
                "time_scale is for emulated workers with the embedded load store; Redis decays "
                "load on its own clock: drop redis_url or time_scale"
            )
        return self

    def redacted(self) -> dict[str, Any]:
        """Settings as shown to operators: secrets and Redis passwords masked."""
        data = self.model_dump(mode="json")
        data["admin_token"] = "***" if self.admin_token else None
        data["model_snapshot_key"] = "***" if self.model_snapshot_key else None
        if self.redis_url:
            data["redis_url"] = redact_redis_url(self.redis_url)
        return data


def _yaml_values(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.values = values

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from flags (``overrides``, None values ignored), env and YAML."""
    path = config_file or os.environ.get("KVROUTE_CONFIG")
    values = _yaml_values(Path(path) if path else None)

    class _Configured(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _YamlSource(settings_cls, values))

    from pydantic import ValidationError

    try:
        configured = _Configured(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors()
        )
        raise SettingsError(f"invalid settings: {problems}") from None
    return configured
