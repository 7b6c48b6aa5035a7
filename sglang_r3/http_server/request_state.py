"""What the hooks of one HTTP request leave for each other on its Starlette request.

The generate hook runs inside upstream's handlers, which answer every ``ValueError``
with 400 and build the OpenAI response themselves; the HTTP hooks around those
handlers read the r3 error (to answer with its own status) and the references (to put
into ``sglext.r3``) from the request's ``scope["state"]``, which upstream shares.
"""

from __future__ import annotations

from typing import Any

from sglang_r3.errors import R3RequestError


def _state(request: Any) -> dict[str, Any] | None:
    """The per-request state dict of a Starlette request (shared with upstream's handlers)."""
    scope = getattr(request, "scope", None)
    if not isinstance(scope, dict):
        return None
    state = scope.setdefault("state", {})
    return state if isinstance(state, dict) else None


def remember_error(request: Any, exc: R3RequestError) -> None:
    """Leave ``exc`` on the request, for the hooks that turn upstream's 400 into its status."""
    state = _state(request)
    if state is not None:
        state["r3_error"] = exc


def remembered_error(request: Any) -> R3RequestError | None:
    """The r3 error :func:`remember_error` left on ``request``, if any."""
    state = _state(request)
    err = state.get("r3_error") if state is not None else None
    return err if isinstance(err, R3RequestError) else None


def hold_refs(request: Any) -> list[dict[str, Any]]:
    """A new list on ``request`` that the generate hook appends each output's reference to."""
    holder: list[dict[str, Any]] = []
    request.state.r3_refs = holder
    return holder


def refs_holder(request: Any) -> list[dict[str, Any]] | None:
    """The list :func:`hold_refs` left on ``request`` (None: no OpenAI handler asked)."""
    state = _state(request)
    holder = state.get("r3_refs") if state is not None else None
    return holder if isinstance(holder, list) else None
