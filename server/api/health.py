"""``/api/health``: the one public API route."""

from __future__ import annotations

from fastapi import APIRouter

from server import __version__
from server.schemas import Health

router = APIRouter(prefix="/api", tags=["health"])


@router.get("/health", response_model=Health)
def health() -> Health:
    """Liveness: answers without a key."""
    return Health(status="ok", version=__version__)
