"""Service settings: ``ORTHORNN_*`` environment variables, overridden by command-line flags
(``orthornn serve --max-batch-size 16`` beats ``ORTHORNN_MAX_BATCH_SIZE=8``). A leaf: the
checks the fields need (a device against a providers list) are here, those of addresses
in ``addresses``, and nothing else of the service is imported."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import quote

from orthornn.export.artifacts.storage import (
    check_location,
    folder_only,
    is_object_uri,
    local_folder,
)
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .addresses import check_store_url, is_loopback

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
#: providers that run on an NVIDIA GPU (TensorRT needs the CUDA provider's libraries too)
GPU_PROVIDERS = (CUDA, "TensorrtExecutionProvider")
#: the bounds of the default body limit (Settings.body_limit): the labels and repository
#: routes' bodies fit the floor (10,000 labels), the ceiling is the fixed limit it replaced
MIN_BODY_BYTES = 4 * 1024 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)


def device_conflict(device: str, providers: list[str]) -> str | None:
    """Why DEVICE contradicts an explicit PROVIDERS list (None: it does not). With
    device auto a providers list is used as given; with cpu it may name no GPU provider;
    with cuda it must name the CUDA provider."""
    if not providers:
        return None
    gpu = [p for p in providers if p in GPU_PROVIDERS]
    if device == "cpu" and gpu:
        return (f"device cpu contradicts providers {providers}, which name GPU providers "
                f"{gpu}: drop them from providers, or leave device at auto to use providers "
                f"as given")
    if device == "cuda" and CUDA not in providers:
        return (f"device cuda contradicts providers {providers}, which do not name {CUDA}: "
                f"add it, or leave device at auto to use providers as given")
    return None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORTHORNN_", extra="forbid",
                                      validate_default=True)

    repo: Path = Field(description="model repository root: REPO/<name>/<version>/")
    repository_cache: Path | None = Field(
        None, description="with --repo s3://BUCKET/PREFIX: the folder the bucket's models "
                          "are mirrored into and served from (an emptyDir in a pod; unset: "
                          "orthornn-repository-<hash of the URI> in the temporary folder)")
    repository_uri: str | None = Field(None, description="set from --repo s3://...")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    address_file: Path | None = Field(
        None, description="once the port is bound, write the URL the server answers on "
                          "from this machine (http://127.0.0.1:PORT for 0.0.0.0) to this "
                          "file; the image's HEALTHCHECK reads it (unset: none written)")
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="models that must be loaded for readiness (empty: every model found in "
                    "the repository at start-up)")
    version_policy: Literal["latest", "all"] = Field(
        "latest", description="latest: serve keep_versions verified versions, the promoted "
                              "one (REPO/<name>/promotion.json) and the newest others; all: "
                              "every verified version")
    keep_versions: int = Field(1, ge=1, le=64,
                               description="versions kept loaded under the 'latest' policy")
    poll_interval_s: float = Field(
        2.0, ge=0, le=3600, description="how often the repository is scanned for new versions "
                                        "(0: never; only the repository API loads)")
    rollout_controller: Literal["auto", "on", "off"] = Field(
        "auto", description="run rollouts (REPO/<name>/rollout.json) from this replica's own "
                            "measurements, advancing, promoting and rolling back: on; off: "
                            "only measure and report them to `orthornn rollout run`, which "
                            "adds every replica's; auto: on when the repository is a folder "
                            "writable here (one replica on a laptop), off when mounted "
                            "read-only or a bucket")
    batching: bool = Field(True, description="dynamic batching on or off")
    max_batch_size: int = Field(32, ge=1, le=4096,
                                description="sequences run together in one batch")
    max_queue_delay_ms: float = Field(
        2.0, ge=0, le=10_000,
        description="how long a request waits for others to fill its batch")
    max_queue_size: int = Field(
        512, ge=1, le=1_000_000,
        description="sequences waiting per model version; beyond it requests get 429")
    max_request_sequences: int = Field(256, ge=1, le=100_000,
                                       description="sequences in one request")
    max_token_length: int = Field(
        1024, ge=1, le=1_000_000,
        description="token limit of language-model inputs when the manifest's max_length "
                    "(the training BPTT window) is smaller: the hidden state carries")
    max_new_tokens: int = Field(256, ge=1, le=100_000,
                                description="upper bound of /generate's max_new_tokens")
    max_inflight_requests: int = Field(
        64, ge=1, le=1_000_000,
        description="requests being answered at once; beyond it 503 with Retry-After at once "
                    "(health and metrics excepted), so answered requests keep a bounded "
                    "latency under overload")
    hold_refused: bool = Field(
        True, description="after such a 503, read nothing more from its connection until "
                          "Retry-After (1 s, plus up to 0.25 s at random) has passed: a client "
                          "that retries at once waits in TCP at no cost to the server instead "
                          "of being refused again; its retry then waits for the next free "
                          "slot, ahead of new requests (eager listener only); turn off behind "
                          "a proxy that sends many clients' requests over one pooled "
                          "connection")
    max_sessions: int = Field(10_000, ge=1, le=10_000_000,
                              description="open server-side sessions; beyond it a new one "
                                          "gets 429")
    max_ended_sessions: int = Field(
        10_000, ge=0, le=10_000_000,
        description="ended sessions kept (each until its idle timeout, so that a retried "
                    "final chunk is answered again); beyond it the oldest ended ones are "
                    "dropped")
    session_secrets: bool = Field(
        True, description="a session belongs to whoever started it: the start's answer "
                          "carries a secret (session_secret, header Orthornn-Session-Secret) "
                          "that every later chunk must present (else 404), and a start on an "
                          "open id gets 409; false (a trusted network only): anyone who knows "
                          "a session id may continue or end it")
    session_idle_timeout_s: float = Field(
        300.0, gt=0, le=86_400,
        description="a session unused this long is ended (its state dropped)")
    session_store: str = Field(
        "memory",
        description="where server-side sessions live: memory (this process; a session is "
                    "tied to its replica) or redis://[:PASSWORD@]HOST[:PORT][/DB] (rediss:// "
                    "for TLS), a Redis that replicas share so a session outlives the replica "
                    "that started it; give a password through the environment variable, "
                    "not the flag")
    session_store_password: SecretStr | None = Field(
        None, description="the session store's Redis password, apart from its URL "
                          "(environment only: ORTHORNN_SESSION_STORE_PASSWORD, e.g. from a "
                          "Kubernetes Secret); percent-encoded into the URL here, so any "
                          "character works")
    session_key_prefix: str = Field(
        "orthornn:", max_length=64, pattern=r"^[A-Za-z0-9_.:{}-]*$",
        description="prefix of the session store's Redis keys: deployments sharing one Redis "
                    "use different prefixes")
    session_store_timeout_s: float = Field(
        0.5, gt=0, le=60,
        description="longest wait for the session store (connect and each call); beyond it "
                    "the request gets 503 with Retry-After")
    capture: Path | None = Field(
        None, description="capture a sampled share of the answered /predict and inference "
                          "requests (inputs, outputs, version) as JSON lines under this "
                          "folder, DIR/<model>/<version>/<day>/<replica>-<n>.jsonl, for "
                          "labels, drift and retraining (unset: off); the records are users' "
                          "data: see capture_retention_days")
    capture_sample: float = Field(
        1.0, gt=0, le=1, description="the share of requests captured, decided by the hash of "
                                     "the request id (X-Request-Id, the OIP id, or one the "
                                     "server makes and returns), alike on every replica")
    capture_retention_days: int = Field(
        30, ge=1, le=3650, description="captured day folders older than this are deleted")
    capture_replica: str | None = Field(
        None, pattern=r"^[A-Za-z0-9._-]{1,128}$",
        description="this replica's name in capture segment names (default: the host name, "
                    "a pod's name on Kubernetes)")
    capture_spool: Path | None = Field(
        None, description="with --capture s3://BUCKET/PREFIX: the folder segments are written "
                          "to and uploaded from as they close (give it a volume that outlives "
                          "the container, an emptyDir in a pod, so that a restarted replica "
                          "uploads what its predecessor left; unset: "
                          "orthornn-capture-<hash of the URI> in the temporary folder)")
    capture_segment_age_s: float = Field(
        60.0, gt=0, le=3600,
        description="with --capture s3://...: the longest a segment stays open before it "
                    "closes and is uploaded (at most this much of the captures, and one "
                    "upload, is lost with a node's local disk)")
    capture_uri: str | None = Field(None, description="set from --capture s3://...")
    drift: bool = Field(
        True, description="test the answered sequences of each version, in windows, against "
                          "the drift reference its package recorded at export "
                          "(orthornn_drift_score, orthornn_drift_detected; docs/drift.md); "
                          "versions without a reference measure nothing")
    drift_window: int | None = Field(
        None, ge=20, le=100_000,
        description="sequences per drift window (default: the window the reference's "
                    "thresholds were calibrated for, 200)")
    drift_interval_s: float = Field(
        1.0, ge=0, le=3600,
        description="at most one drift test per version per this many seconds; windows that "
                    "fill sooner are skipped (bounds the tests' CPU at any request rate; 0: "
                    "test every window)")
    max_body_bytes: int | None = Field(
        None, ge=1024, le=1 << 31,
        description="request body limit (413 beyond it); unset: the largest request the "
                    "loaded models take, written as JSON (max_request_sequences sequences "
                    "of max_length steps, 32 bytes a number), at least 4 MiB (the labels "
                    "and repository routes) and at most 16 MiB")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, le=1 << 26,
        description="request head limit (request line and headers); beyond it 431 and the "
                    "connection is closed, read no further than the limit (the h11 "
                    "protocol answers 400)")
    max_receiving_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, le=1 << 40,
        description="request body bytes being received at once over all connections "
                    "(a request takes an in-flight slot only once its body is in); beyond "
                    "it 503 with Retry-After (at least max_body_bytes is allowed)")
    min_body_rate: float = Field(
        240.0, ge=0, le=1 << 30,
        description="a request body still being received 5 s after its first byte must "
                    "have come at this many bytes a second on average, else 408 and the "
                    "connection is closed (Kestrel's MinRequestBodyDataRate; 0: no minimum). "
                    "Past those 5 s, when max_receiving_bytes is full, the bodies holding "
                    "the most of it are evicted (503) before a new request is refused")
    max_lm_output_bytes: int = Field(
        64 * 1024 * 1024, ge=0, le=1 << 40,
        description="budget of a request's per-step outputs (language models: B x T x "
                    "vocabulary x 4 bytes of logits); beyond it 413 before the model runs; "
                    "/generate reads a longer prompt in pieces within it (0: no limit)")
    max_output_bytes_in_flight: int = Field(
        256 * 1024 * 1024, ge=0, le=1 << 40,
        description="per-step output bytes of the answers being made at once (from a "
                    "request's checks to its encoded answer), over all requests, each "
                    "counted as max_lm_output_bytes counts it (OIP JSON answers as "
                    "written: 17 bytes a value); beyond it 503 with Retry-After, one "
                    "request is always let in (0: no limit)")
    header_timeout_s: float = Field(
        10.0, ge=0, le=3600,
        description="longest time to receive a request's head (request line and headers), "
                    "from the connection's accept, or on a kept-alive connection from the "
                    "next request's first byte (the wait for it is the 30 s keep-alive); "
                    "beyond it the connection is closed, with 408 when a byte of it came, "
                    "and counted in orthornn_slow_client_closes_total (0: no limit)")
    body_timeout_s: float | None = Field(
        None, ge=0, le=86_400,
        description="longest time to receive a request's body, from its head to its last "
                    "byte; beyond it the connection is closed, with 408 when no answer has "
                    "started (unset: max(30, max_body_bytes / 64 KiB) s, 256 s for 16 MiB; "
                    "0: no limit). Neither deadline covers the answer (inference, streaming)")
    inference_threads: int = Field(
        1, ge=0, le=256,
        description="onnxruntime intra-op threads per session (0: onnxruntime's default)")
    inference_workers: int = Field(
        1, ge=1, le=64,
        description="inference threads (batches run at once, over all models); on a small "
                    "machine one leaves the other cores to HTTP, more suit many cores")
    providers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="onnxruntime execution providers, used as given (empty: chosen by "
                    "device)")
    device: Device = Field(
        "auto", description="where models run: auto (CUDA when onnxruntime's CUDA provider "
                            "can load here, else the CPU), cpu, or cuda (refuse to start "
                            "without it); with providers set, cpu forbids GPU providers and "
                            "cuda requires CUDAExecutionProvider")
    admin_token: SecretStr | None = Field(
        None, description="bearer token of the repository API (load, unload, index); unset: "
                          "the API is open, which the service allows only on a loopback "
                          "host unless allow_open_repository_api is set")
    labels_token: SecretStr | None = Field(
        None, description="a second bearer token that POST /v2/models/{name}/labels also "
                          "takes (the admin token works too), so that a labelling system "
                          "need not hold the admin token; unset: the admin token's rules")
    allow_open_repository_api: bool = Field(
        False, description="start without admin_token also when listening beyond loopback "
                           "(anyone who reaches the port may load and unload models)")
    shutdown_delay_s: float = Field(
        0.0, ge=0, le=600,
        description="after SIGTERM, seconds readiness answers 503 while requests are still "
                    "accepted (lets load balancers notice), before the listener closes")
    drain_timeout_s: float = Field(30.0, ge=0, le=3600,
                                   description="longest wait for in-flight requests on exit")
    listener: Literal["eager", "uvicorn"] = Field(
        "eager", description="eager: accept every waiting connection at each readiness "
                             "(no client waits in the listen queue under overload; uses "
                             "uvicorn beyond its public surface, service/server/listener.py); "
                             "uvicorn: uvicorn's own listener")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the service's log level")
    tracing: bool = Field(
        False, description="OpenTelemetry traces: a server span per request with its decode, "
                           "queue, inference and encode spans, the parent from the request's "
                           "traceparent, exported as the OTEL_* variables say (OTLP over "
                           "HTTP to OTEL_EXPORTER_OTLP_ENDPOINT); needs the otel extra")

    def body_limit(self, largest: int) -> int:
        """The request body limit: max_body_bytes, or when unset LARGEST (the JSON body of
        the loaded models' largest request) within [MIN_BODY_BYTES, MAX_BODY_BYTES]."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return min(max(largest, MIN_BODY_BYTES), MAX_BODY_BYTES)

    def body_timeout(self) -> float:
        """body_timeout_s, or when unset one that scales with the body limit (the largest
        it can be): the limit at 64 KiB/s (a slow but legitimate upload), at least 30 s."""
        if self.body_timeout_s is not None:
            return self.body_timeout_s
        return max(30.0, (self.max_body_bytes or MAX_BODY_BYTES) / (64 * 1024))

    @model_validator(mode="before")
    @classmethod
    def _buckets(cls, data: Any) -> Any:
        """--repo s3://...: the bucket is repository_uri, the folder served its cache;
        --capture s3://...: the bucket is capture_uri, the folder written its spool."""
        for field, cache, kind in (("repo", "repository_cache", "repository"),
                                   ("capture", "capture_spool", "capture")):
            value = data.get(field) if isinstance(data, dict) else None
            if not (isinstance(value, str) and is_object_uri(value)):
                continue
            uri = check_location(value, field).rstrip("/")
            folder = data.get(cache) or local_folder(uri, kind)
            data = {**data, field: str(folder), f"{kind}_uri": uri}
        return data

    @field_validator("repo", "capture", mode="before")
    @classmethod
    def _folder(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):  # s3://: refused by name, never folded to "s3:/..."
            folder_only(value, str(info.field_name))
        return value

    @field_validator("models", "providers", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # --models a,b or ORTHORNN_MODELS=a,b
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    def repository_api_exposure(self) -> str | None:
        """Why the service must not start (the repository API would be open beyond
        loopback), or None."""
        if self.admin_token is not None or self.allow_open_repository_api \
                or is_loopback(self.host):
            return None
        return (f"host {self.host}: the repository API (load, unload, index) would be open "
                f"to anyone reaching port {self.port}; set ORTHORNN_ADMIN_TOKEN, listen on "
                f"127.0.0.1, or pass --allow-open-repository-api "
                f"(ORTHORNN_ALLOW_OPEN_REPOSITORY_API=true) to allow it")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str, info: ValidationInfo) -> str:
        conflict = device_conflict(value, info.data.get("providers") or [])
        if conflict:
            raise ValueError(conflict)
        return value

    @field_validator("session_store")
    @classmethod
    def _session_store(cls, value: str) -> str:
        check_store_url(value)
        return value

    @field_validator("admin_token", "labels_token", "session_store_password", mode="before")
    @classmethod
    def _empty_token(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _store_password(self) -> Settings:
        """session_store_password goes into session_store's URL, percent-encoded (a
        password with / ? # @ % : would otherwise break the URL)."""
        if self.session_store_password is None:
            return self
        parts = check_store_url(self.session_store)
        if parts is None:
            raise ValueError("session_store_password: set only with a Redis session_store "
                             "(redis:// or rediss://)")
        if parts.password is not None:
            raise ValueError("session_store_password: the session_store URL holds a password "
                             "already; give it once")
        user = quote(parts.username or "", safe="")
        password = quote(self.session_store_password.get_secret_value(), safe="")
        host = parts.netloc.rpartition("@")[2]
        self.session_store = parts._replace(netloc=f"{user}:{password}@{host}").geturl()
        return self
