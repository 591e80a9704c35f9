"""The service's one ``Settings``: every environment variable it reads is here (``ROUNDHOUSE_*``)."""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.distributed import RENDEZVOUS_PORT


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROUNDHOUSE_", extra="ignore")

    home: Path = Field(Path("data"), description="datasets, models, runs and the SQLite file live here")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite in home")
    redis_url: str | None = Field(None, description="Celery broker; default: a no-server folder transport")
    max_upload_bytes: int = Field(2 * 2**30, ge=1, description="largest dataset upload")
    hf_cache: Path | None = Field(
        None, description="Hugging Face hub cache (default: ~/.cache/huggingface/hub)"
    )
    host: str = Field("127.0.0.1", description="the address `roundhouse serve` listens on")
    port: int = Field(8000, description="the port `roundhouse serve` listens on, and login links name")
    queue: str = Field("roundhouse", description="the Celery queue jobs are sent to")
    lease_seconds: float = Field(
        30.0, gt=0, description="a job whose worker is silent this long is interrupted"
    )
    cancel_grace_seconds: float = Field(60.0, ge=0, description="time to stop cleanly before a kill")
    telemetry_seconds: float = Field(2.0, gt=0, description="GPU sampling interval of the worker")
    public_url: str | None = Field(None, description="the URL printed for login (default http://host:port)")
    web_dir: Path | None = Field(
        None, description="the web UI's folder (default: web/ of the source tree; the image sets it)"
    )
    login_link_minutes: float = Field(10.0, gt=0, description="how long a one-time login link works")
    session_days: float = Field(30.0, gt=0, description="how long a browser stays logged in")
    requeue_after_seconds: float = Field(
        300.0, gt=0, description="a queued job no worker claimed this long is sent to the broker again"
    )
    max_retries: int = Field(
        2, ge=0, description="restarts of a training process killed by a signal, from its last checkpoint"
    )
    worker_host: str | None = Field(
        None,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the host name a worker reports and is pinned by (default: this machine's name)",
    )
    worker_gpus: int | None = Field(
        None, ge=0, le=1024, description="GPUs a worker offers (default: what NVML counts here)"
    )
    advertise_address: str | None = Field(
        None,
        max_length=255,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9.:_-]*$",
        description="the address the other boxes of a job on several hosts reach this worker's host by"
        " (default: this host's resolved IP, else the first address of a NIC that is up)",
    )
    rendezvous_port: int = Field(
        RENDEZVOUS_PORT,
        ge=1,
        le=65535,
        description="the TCP port this host listens on as a job's first box (the others join it there)",
    )
    box_interface: str | None = Field(
        None,
        max_length=64,
        description="the NIC the boxes exchange gradients over (default: the one with the advertised"
        " address)",
    )

    @field_validator("advertise_address", "box_interface", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """An empty value (a compose file's ``${VAR:-}``) means the default."""
        return None if value == "" else value

    box_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="a box waiting this long for another (a rendezvous, an exchange) stops: box lost",
    )
    inference_host: str = Field(
        "127.0.0.1", description="the address a worker's inference service listens on (0.0.0.0: every one)"
    )
    inference_port: int = Field(0, ge=0, le=65535, description="its port (0: a free one, chosen at start)")
    inference_advertise: str | None = Field(
        None, description="the host name the API reaches the inference service by (default: inference_host)"
    )
    inference_cpu_max_params: int = Field(
        4_000_000_000,
        ge=0,
        description="the largest model served on the CPU while a job trains (bigger ones get a 503 then)",
    )
    inference_release_seconds: float = Field(
        10.0, ge=0, description="how long answers in flight may finish when a job takes the devices"
    )
    storage_url: str | None = Field(
        None, description="where datasets and runs are stored: unset (home) or s3://bucket/prefix"
    )
    s3_endpoint_url: str | None = Field(None, description="the S3 API's address (MinIO: http://host:9000)")
    s3_public_endpoint_url: str | None = Field(
        None, description="the S3 address presigned URLs use, when browsers reach the store by another name"
    )
    s3_access_key_id: str | None = Field(None, description="S3 credentials (unset: boto3's AWS_* chain)")
    s3_secret_access_key: str | None = Field(None, description="S3 credentials (unset: boto3's AWS_* chain)")
    s3_region: str | None = Field(None, description="S3 region (unset: boto3's AWS_DEFAULT_REGION)")
    storage_presigned_downloads: bool = Field(
        False, description="redirect downloads to presigned URLs (the store must be reachable by browsers)"
    )
    hub_offline: bool = Field(
        False, description="no Hugging Face Hub traffic: pulls and pushes are refused, saying so"
    )
    hub_endpoint: str = Field("https://huggingface.co", description="the Hugging Face Hub's address")
    hub_token: SecretStr | None = Field(
        None, description="a Hub access token, for gated and private repos and for pushes (never stored)"
    )
    hub_keep_free_bytes: int = Field(
        1 << 30, ge=0, description="disk space a model pull must leave free beside its files"
    )
    checkpoint_reserve_bytes: int = Field(
        256 << 20,
        ge=0,
        description="disk space a checkpoint must leave free beside it (else the job pauses, saying so)",
    )
    wandb_api_key: SecretStr | None = Field(
        None, description="the W&B API key jobs with tracking.wandb log with (never stored in a job)"
    )
    mlflow_tracking_token: SecretStr | None = Field(
        None, description="a bearer token for the MLflow servers jobs log to (never stored in a job)"
    )
    mlflow_tracking_username: str | None = Field(None, description="MLflow basic auth user")
    mlflow_tracking_password: SecretStr | None = Field(None, description="MLflow basic auth password")
    allow_unconfined_graders: bool = Field(
        False,
        description=(
            "run python graders on a box whose kernel gives them no confinement (no seccomp, or neither"
            " bubblewrap's namespaces nor Landlock), guarded by Python audit hooks alone; off: refused"
        ),
    )
    allow_image_urls: bool = Field(
        False,
        description=(
            "fetch the http(s) image URLs an uploaded dataset's rows name (once, at the upload; the"
            " images are stored with it); off: such a row is refused, naming its line"
        ),
    )
    hub_xet: bool = Field(
        True, description="pushes upload weights through Xet (hf-xet); off: Git LFS, for a Hub without Xet"
    )

    @property
    def broker_dir(self) -> Path:
        return self.home.resolve() / "broker"

    @property
    def datasets_dir(self) -> Path:
        return self.home.resolve() / "datasets"

    @property
    def models_dir(self) -> Path:
        return self.home.resolve() / "models"

    @property
    def runs_dir(self) -> Path:
        return self.home.resolve() / "runs"

    @property
    def cache_dir(self) -> Path:
        """Local copies of stored objects (checkpoints for the playground, merged builds)."""
        return self.home.resolve() / "cache"

    @property
    def hf_cache_dir(self) -> Path:
        return self.hf_cache or Path.home() / ".cache" / "huggingface" / "hub"

    @property
    def host_name(self) -> str:
        """The worker's host name: ``worker_host``, else this machine's (read when asked, not at import)."""
        return self.worker_host or socket.gethostname()

    def child_environment(self) -> dict[str, str]:
        """What a child process (worker, server process, training run) needs to see the same data."""
        env = {"ROUNDHOUSE_HOME": str(self.home.resolve()), "ROUNDHOUSE_DATABASE_URL": self.url}
        storage = {
            "STORAGE_URL": self.storage_url,
            "S3_ENDPOINT_URL": self.s3_endpoint_url,
            "S3_PUBLIC_ENDPOINT_URL": self.s3_public_endpoint_url,
            "S3_ACCESS_KEY_ID": self.s3_access_key_id,
            "S3_SECRET_ACCESS_KEY": self.s3_secret_access_key,
            "S3_REGION": self.s3_region,
        }
        env |= {f"ROUNDHOUSE_{name}": value for name, value in storage.items() if value}
        if self.storage_presigned_downloads:
            env["ROUNDHOUSE_STORAGE_PRESIGNED_DOWNLOADS"] = "1"
        env["ROUNDHOUSE_HUB_OFFLINE"] = "1" if self.hub_offline else "0"
        env["ROUNDHOUSE_HUB_ENDPOINT"] = self.hub_endpoint
        env["ROUNDHOUSE_HUB_KEEP_FREE_BYTES"] = str(self.hub_keep_free_bytes)
        env["ROUNDHOUSE_HUB_XET"] = "1" if self.hub_xet else "0"
        env["ROUNDHOUSE_CHECKPOINT_RESERVE_BYTES"] = str(self.checkpoint_reserve_bytes)
        env["ROUNDHOUSE_ALLOW_UNCONFINED_GRADERS"] = "1" if self.allow_unconfined_graders else "0"
        if self.hub_token is not None:
            env["ROUNDHOUSE_HUB_TOKEN"] = self.hub_token.get_secret_value()
        secrets = {
            "WANDB_API_KEY": self.wandb_api_key,
            "MLFLOW_TRACKING_TOKEN": self.mlflow_tracking_token,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_tracking_password,
        }
        env |= {f"ROUNDHOUSE_{k}": v.get_secret_value() for k, v in secrets.items() if v is not None}
        if self.mlflow_tracking_username:
            env["ROUNDHOUSE_MLFLOW_TRACKING_USERNAME"] = self.mlflow_tracking_username
        return env

    @property
    def url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'roundhouse.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    """This process's settings, read from the environment once. Routes take the app's instead
    (``SettingsDep``): a test builds an app on settings of its own."""
    return Settings()
