"""``/api/health``: the one public API route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server import __version__
from server.deps import SessionDep, caller
from server.errors import documented
from server.schemas import Health

# 422: a query parameter with a control character (``deps.plain_parameters``, on every route)
router = APIRouter(prefix="/api", tags=["health"], responses=documented(422))


@router.get("/health", response_model=Health)
def health(request: Request, session: SessionDep) -> Health:
    """Liveness, and whether the caller's key is valid: answers without a key."""
    return Health(status="ok", version=__version__, authenticated=caller(request, session) is not None)
