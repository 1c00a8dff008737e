"""The one settings model: environment variables ``DPCOORD_<FIELD>``, CLI flags ``--field``,
and Helm values all map onto these fields.

Each field's annotation names the role that reads it (``NatsSetting[str]`` is read by every
process that connects to NATS), so that each command's ``--help`` lists only the settings it
uses. Every process still reads every ``DPCOORD_`` variable from its environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.ops.setting_checks import check_consistent
from service.ops.setting_groups import (
    CoordinatorSetting,
    EngineSetting,
    GatewaySetting,
    NatsSetting,
    ServiceSetting,
    SettingGroup,
    TorchSetting,
    group_of,
)
from service.protocol.subjects import ID_PATTERN


def settings_in(groups: tuple[SettingGroup, ...]) -> dict[str, FieldInfo]:
    """The ``Settings`` fields read by the given groups, in declaration order."""
    return {name: field for name, field in Settings.model_fields.items() if group_of(field) in groups}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPCOORD_", extra="ignore")

    # NATS connection
    nats_url: NatsSetting[str] = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma separated")
    subject_prefix: NatsSetting[str] = Field(
        "dpcoord", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", description="First subject tokens"
    )
    nats_user: NatsSetting[str | None] = Field(None, description="NATS user name")
    nats_password: NatsSetting[str | None] = Field(None, description="NATS password")
    nats_token: NatsSetting[str | None] = Field(None, description="NATS auth token")
    nats_nkey_seed_file: NatsSetting[str | None] = Field(None, description="Path to an nkey seed file")
    nats_creds_file: NatsSetting[str | None] = Field(None, description="Path to a NATS .creds file (JWT + nkey)")
    nats_tls_ca_file: NatsSetting[str | None] = Field(None, description="CA bundle to verify the NATS server")
    nats_tls_cert_file: NatsSetting[str | None] = Field(None, description="Client certificate for mutual TLS")
    nats_tls_key_file: NatsSetting[str | None] = Field(None, description="Client key for mutual TLS")
    nats_tls_hostname: NatsSetting[str | None] = Field(
        None, description="Name the NATS server certificate must carry; default: the host in nats_url"
    )
    nats_tls_handshake_first: NatsSetting[bool] = Field(
        False, description="Start TLS before the server speaks (server tls.handshake_first); no plaintext downgrade"
    )
    nats_inbox_prefix: NatsSetting[str] = Field(
        "_INBOX",
        pattern=r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$",
        description="Subject prefix of this process's reply inboxes; one per NATS user keeps replies private",
    )
    nats_connect_timeout_s: NatsSetting[float] = Field(5.0, gt=0, description="Timeout of one connection attempt")

    # Coordinator
    coordinator_id: CoordinatorSetting[str | None] = Field(
        None, pattern=ID_PATTERN, description="Coordinator replica id; random when unset"
    )
    queue_group: CoordinatorSetting[str] = Field(
        "dpcoord-coordinators", description="Queue group shared by coordinator replicas"
    )
    routing_policy: CoordinatorSetting[Literal["least_loaded", "p2c", "round_robin", "prefix", "cache_aware"]] = Field(
        "cache_aware",
        description="How a request picks an engine: least_loaded, p2c (less loaded of two drawn at random), round_robin, "
        "prefix (where its prompt's longest prefix went, within prefix_load_bound), or cache_aware (the engines' KV "
        "events blended with load; sessions and groups kept together); see docs/protocol.md",
    )
    routing_load_slack: CoordinatorSetting[int] = Field(
        8,
        ge=0,
        description="least_loaded, p2c, prefix: an engine already receiving a batch this event-loop turn keeps getting "
        "requests while its load is at most the least loaded engine's plus this, so routed messages stay batched",
    )
    prefix_load_bound: CoordinatorSetting[int] = Field(
        32,
        ge=0,
        description="prefix: a prefix's engine is chosen while its load is at most the least loaded engine's plus this",
    )
    prefix_table_size: CoordinatorSetting[int] = Field(
        100_000, ge=1, description="prefix: most prompt prefixes remembered (least recently used forgotten first)"
    )
    prefix_ttl_s: CoordinatorSetting[float] = Field(
        600.0, gt=0, description="prefix: a prompt prefix unused this long is forgotten"
    )
    cache_aware_request_tokens: CoordinatorSetting[int] = Field(
        256,
        ge=1,
        description="cache_aware: prompt tokens that weigh as one request in flight, in an engine's load (its queued "
        "tokens) and in its score (the prefix it holds)",
    )
    cache_aware_prefix_weight: CoordinatorSetting[float] = Field(
        8.0,
        ge=0,
        description="cache_aware: how many times over the prompt prefix an engine holds (or is computing) counts "
        "against its load in its score; high, so the holder keeps the prompt until its affinity yields",
    )
    cache_aware_load_factor: CoordinatorSetting[float] = Field(
        1.25,
        ge=1,
        description="cache_aware: an engine's affinity (held prefix, session, group) yields once its requests in "
        "flight pass this times the mean, and the mean plus cache_aware_load_slack",
    )
    cache_aware_load_slack: CoordinatorSetting[float] = Field(
        8.0,
        ge=0,
        description="cache_aware: affinity also holds while an engine's requests in flight are within the mean plus this",
    )
    cache_aware_prediction_ttl_s: CoordinatorSetting[float] = Field(
        2.0,
        gt=0,
        description="cache_aware: a routed prompt's prefixes count as held by its engine this long, before the "
        "engine's KV events say so (a burst of siblings follows the first)",
    )
    kv_index_size: CoordinatorSetting[int] = Field(
        1_000_000,
        ge=1,
        description="cache_aware: most (engine, prefix) pairs the block index holds, shared evenly among the engines "
        "(each forgets its oldest first); predictions are bounded alike",
    )
    session_table_size: CoordinatorSetting[int] = Field(
        100_000, ge=1, description="cache_aware: most sessions and groups whose engine is remembered"
    )
    session_ttl_s: CoordinatorSetting[float] = Field(
        600.0, gt=0, description="cache_aware: a session or group unused this long forgets its engine"
    )
    max_inflight_per_engine: CoordinatorSetting[int] = Field(
        256, ge=1, description="Requests in flight per engine before queueing"
    )
    max_queued_requests: CoordinatorSetting[int] = Field(
        4096, ge=0, description="Requests held by the coordinator before 429"
    )
    max_payload_bytes: CoordinatorSetting[int] = Field(
        1024 * 1024, ge=1024, description="Largest accepted message body (413 beyond)"
    )
    request_timeout_s: CoordinatorSetting[float] = Field(
        300.0, gt=0, description="Default request deadline (504 after it)"
    )
    control_timeout_s: CoordinatorSetting[float] = Field(
        5.0, gt=0, description="How long engines have to confirm a control signal"
    )
    heartbeat_timeout_s: CoordinatorSetting[float] = Field(
        3.0, gt=0, description="Engines silent this long are removed"
    )
    max_retries: CoordinatorSetting[int] = Field(
        2, ge=0, description="Re-dispatches of a request whose engine died before streaming"
    )
    max_migrations: CoordinatorSetting[int] = Field(
        3,
        ge=0,
        description="Times a streamed request whose engine died continues on another engine from its last "
        "streamed token (503 beyond)",
    )
    result_ttl_s: CoordinatorSetting[float] = Field(
        60.0, ge=0, description="How long named clients' results are kept for resubmissions"
    )
    result_cache_size: CoordinatorSetting[int] = Field(100_000, ge=0, description="Most results kept for resubmissions")
    reconnect_grace_s: CoordinatorSetting[float] = Field(
        1.5, ge=0, description="After a NATS reconnect, hold replies this long so clients resubscribe first"
    )
    # Limits on what peers may send or make the coordinator hold (docs/security.md)
    reply_inbox_prefixes: CoordinatorSetting[str] = Field(
        "_INBOX",
        pattern=r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*(,[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*)*$",
        description="Comma-separated inbox prefixes replies may go to, each also covering itself plus _ and a name "
        "(_INBOX covers _INBOX_client); the prefix a reply subject is under owns the request",
    )
    max_id_bytes: CoordinatorSetting[int] = Field(
        256,
        ge=16,
        description="Longest client_id, client_request_id, engine or coordinator id and reply subject, in UTF-8 bytes (400 beyond)",
    )
    max_request_timeout_s: CoordinatorSetting[float] = Field(
        3600.0, gt=0, description="Longest deadline a request may ask for in timeout_s (400 beyond)"
    )
    max_queued_bytes: CoordinatorSetting[int] = Field(
        256 * 1024 * 1024, ge=0, description="Bytes of request bodies the coordinator queue holds before 429"
    )
    max_client_share: CoordinatorSetting[float] = Field(
        0.5,
        gt=0,
        le=1,
        description="Most of the fleet's slots one client (inbox prefix) holds while others wait; 1: no limit",
    )
    max_engines: CoordinatorSetting[int] = Field(
        4096, ge=1, description="Engines the coordinator admits (register beyond: 429)"
    )
    engine_progress_timeout_s: CoordinatorSetting[float] = Field(
        10.0,
        gt=0,
        description="An engine holding requests that sends no reply and takes no step this long is suspected: "
        "its requests are retried elsewhere and it gets no new work until it answers",
    )
    result_cache_bytes: CoordinatorSetting[int] = Field(
        256 * 1024 * 1024, ge=0, description="Bytes of results kept for resubmissions (oldest dropped first)"
    )
    max_buffered_bytes: CoordinatorSetting[int] = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Bytes of replies held for later delivery (across a NATS reconnect; orphans while a replica starts); oldest dropped first",
    )
    long_control_timeout_s: CoordinatorSetting[float] = Field(
        600.0,
        gt=0,
        description="How long engines have to confirm what takes long: each phase of update_weights (loading a "
        "checkpoint) and a drain pause (requests in flight finishing)",
    )

    # Engine
    engine_id: EngineSetting[str | None] = Field(
        None, pattern=ID_PATTERN, description="Engine id (letters, digits, '_', '-'); random when unset"
    )
    backend: EngineSetting[Literal["echo", "torch"]] = Field(
        "torch", description="Engine backend: torch runs a model, echo is the protocol test double"
    )
    token_delay_ms: EngineSetting[float] = Field(0.0, ge=0, description="Echo backend: delay per generated token")
    engine_capacity: EngineSetting[int] = Field(256, ge=1, description="Requests an engine accepts at once")
    heartbeat_interval_s: EngineSetting[float] = Field(1.0, gt=0, description="Engine heartbeat period")
    stream_interval: EngineSetting[int] = Field(1, ge=1, description="Tokens per streamed partial")
    max_stop_strings: EngineSetting[int] = Field(
        16, ge=0, description="Most stop strings a request may give (400 beyond)"
    )
    max_stop_string_bytes: EngineSetting[int] = Field(
        256, ge=1, description="Longest stop string, in UTF-8 bytes (400 beyond)"
    )
    recent_replies_bytes: EngineSetting[int] = Field(
        64 * 1024 * 1024, ge=0, description="Bytes of terminal replies an engine remembers to send again after a loss"
    )
    served_model_name: EngineSetting[str | None] = Field(
        None,
        min_length=1,
        max_length=256,
        description="Model name the engine serves (routing by model, the gateway's /v1/models); unset: the model directory's name, dpcoord-random for the random default, dpcoord-echo for echo",
    )

    # Torch backend (see docs/engines.md)
    device: TorchSetting[str] = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="Torch device: auto (cuda when available), cpu, cuda or cuda:N",
    )
    dtype: TorchSetting[Literal["auto", "float32", "bfloat16", "float16"]] = Field(
        "auto",
        description="Weights and KV cache dtype; auto: the checkpoint's dtype, else bfloat16 on CUDA, float32 on CPU",
    )
    cpu_threads: TorchSetting[int | None] = Field(
        None,
        ge=1,
        description="Torch intra-op threads on CPU; unset: torch's default (all cores). Engines sharing a host: cores / engines",
    )
    model_seed: TorchSetting[int] = Field(
        0, description="Seed of the random default model (torch backend without --model)"
    )
    max_batch: TorchSetting[int] = Field(
        128, ge=1, description="Requests decoded together in one step; more wait in the engine's queue"
    )
    max_context: TorchSetting[int | None] = Field(
        None, ge=2, description="Tokens per request, prompt plus generated; unset: the model's max_position_embeddings"
    )
    max_prefill_tokens: TorchSetting[int] = Field(
        4096, ge=1, description="Prompt tokens prefilled in one step (one longer prompt still runs alone)"
    )
    kv_block_size: TorchSetting[int] = Field(16, ge=1, description="Tokens per KV-cache page")
    kv_cache_gb: TorchSetting[float | None] = Field(
        None, gt=0, description="KV-cache budget in GiB; unset: sized from the memory free after loading"
    )
    kv_memory_fraction: TorchSetting[float] = Field(
        0.9,
        gt=0,
        le=1,
        description="Share of free memory the KV cache may take (CUDA: of the device, less the rest's share; CPU: of available RAM)",
    )
    profile_dir: TorchSetting[str | None] = Field(
        None, description="Where CPU torch.profiler traces are written; unset: the system temp directory"
    )
    prefix_caching: TorchSetting[bool] = Field(
        True, description="Reuse the KV-cache pages of a prompt prefix another request already computed"
    )
    cuda_graphs: TorchSetting[bool] = Field(
        True, description="CUDA: decode steps replay CUDA graphs captured per batch size; false: eager decode"
    )
    torch_compile: TorchSetting[bool] = Field(
        True, description="CUDA: fuse element-wise pieces (RMSNorm, rotary, SwiGLU) with torch.compile; false: eager"
    )
    require_fast_path: TorchSetting[bool] = Field(
        False,
        description="Refuse to start unless decode replays CUDA graphs over the Triton paged kernel with torch.compile pieces",
    )

    # Health and metrics over HTTP (Kubernetes probes, Prometheus)
    http_host: ServiceSetting[str] = Field(
        "0.0.0.0", description="Address of the /healthz, /readyz and /metrics server"
    )
    http_port: ServiceSetting[int] = Field(
        8080,
        ge=0,
        le=65535,
        description="Port of /healthz, /readyz and /metrics; 0 turns them off. Left unset and taken: a free port, logged",
    )

    # The OpenAI-compatible HTTP gateway (dpcoord gateway; docs/gateway.md)
    gateway_host: GatewaySetting[str] = Field("0.0.0.0", description="Address the HTTP gateway listens on")
    gateway_port: GatewaySetting[int] = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the HTTP gateway (/v1/*, /healthz, /readyz, /metrics); 0: a free port",
    )
    gateway_api_key_file: GatewaySetting[str | None] = Field(
        None,
        description="File of API keys, one per line, the gateway accepts as 'Authorization: Bearer <key>'; unset (and no --api-key): no key needed",
    )
    gateway_drain_s: GatewaySetting[float] = Field(
        30.0,
        ge=0,
        description="Seconds the gateway lets requests in progress run after SIGTERM: /readyz and /health fail at once and new generation requests get 503 shutting_down; streams still running then end with an error event and [DONE], other requests with a 503 error body. Match the pod's terminationGracePeriodSeconds",
    )
    gateway_stream_buffer_bytes: GatewaySetting[int] = Field(
        1 << 20,
        ge=65536,
        description="Bytes of a stream's replies the gateway keeps for an HTTP client that reads slower than its engine generates; past them the request is held in its engine until the client catches up (docs/gateway.md, Backpressure)",
    )
    gateway_stream_stall_s: GatewaySetting[float] = Field(
        60.0,
        gt=0,
        description="Seconds a stream may stay held for an HTTP client that reads nothing: its request is then aborted and the stream ends with an error event when the client reads again; a connection whose writes stay blocked twice as long is closed",
    )
    gateway_read_timeout_s: GatewaySetting[float] = Field(
        10.0,
        gt=0,
        description="Seconds an HTTP client has to send a whole request, head and body, from connecting or from the first byte of a later request (408 after it)",
    )
    gateway_idle_timeout_s: GatewaySetting[float] = Field(
        30.0, gt=0, description="Seconds an idle keep-alive HTTP connection is kept open"
    )
    gateway_max_connections: GatewaySetting[int] = Field(
        4096, ge=1, description="Concurrent HTTP connections per gateway process; one more is answered 503 and closed"
    )
    gateway_max_header_bytes: GatewaySetting[int] = Field(
        16384, ge=1024, description="Bytes of a request head (request line and header fields); beyond it: 431"
    )
    gateway_max_headers: GatewaySetting[int] = Field(
        100, ge=8, description="Header fields of a request; beyond it: 431"
    )
    gateway_workers: GatewaySetting[int] = Field(
        1, ge=1, le=256, description="Gateway processes sharing the port through SO_REUSEPORT (for many-core hosts)"
    )

    log_level: ServiceSetting[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = Field("INFO", description="Log level")
    event_loop: ServiceSetting[Literal["auto", "asyncio", "uvloop"]] = Field(
        "auto", description="Event loop; auto takes uvloop when installed"
    )
    # Tracing with OpenTelemetry (docs/protocol.md, *Tracing*; the otel extra): off unless an endpoint is set.
    otlp_endpoint: ServiceSetting[str | None] = Field(
        None,
        pattern=r"^https?://[^\s]+$",
        description="Base URL of an OTLP/HTTP collector (http://collector:4318); spans go to its /v1/traces. "
        "Unset: tracing off, and OpenTelemetry is not imported",
    )
    trace_sample_ratio: ServiceSetting[float] = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of requests traced where a trace starts; a request that arrives with a W3C "
        "traceparent follows its sampled flag",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """The rules between fields (service/ops/setting_checks.py); a ValueError names the first broken."""
        check_consistent(self)
        return self
