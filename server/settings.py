"""The service's one ``Settings``: every environment variable it reads is here (``ROUNDHOUSE_*``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    playground_max_params: int = Field(
        4_000_000_000, ge=0, description="the largest model the chat playground runs (on the API host's CPU)"
    )
    playground_threads: int = Field(2, ge=1, le=64, description="playground generations running at once")
    playground_cached_models: int = Field(2, ge=1, le=16, description="models the playground keeps loaded")

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
    def hf_cache_dir(self) -> Path:
        return self.hf_cache or Path.home() / ".cache" / "huggingface" / "hub"

    def child_environment(self) -> dict[str, str]:
        """What a child process (worker, server process, training run) needs to see the same data."""
        return {"ROUNDHOUSE_HOME": str(self.home.resolve()), "ROUNDHOUSE_DATABASE_URL": self.url}

    @property
    def url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'roundhouse.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    """This process's settings, read from the environment once. Routes take the app's instead
    (``SettingsDep``): a test builds an app on settings of its own."""
    return Settings()
