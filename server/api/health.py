"""``/api/health``: the one public API route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server import __version__
from server.deps import SessionDep, presented_key
from server.schemas import Health
from server.services import keys

router = APIRouter(prefix="/api", tags=["health"])


@router.get("/health", response_model=Health)
def health(request: Request, session: SessionDep) -> Health:
    """Liveness, and whether the caller's key is valid: answers without a key."""
    key = presented_key(request)
    valid = key is not None and keys.check_key(session, key=key) is not None
    return Health(status="ok", version=__version__, authenticated=valid)
