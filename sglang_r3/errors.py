"""The errors the extension raises: into SGLang's request handlers, and at start-up.

``R3RequestError`` is both a ``fastapi.HTTPException`` (the OpenAI handlers keep its status) and a
``ValueError`` (``/generate`` turns ValueErrors into error responses, reading
``status_code`` when present, and streams them as an error chunk).  So every path
answers with the intended 4xx/5xx and a sentence, never a traceback.
"""

from __future__ import annotations

from fastapi import HTTPException


class R3RequestError(HTTPException, ValueError):
    """A tagged request cannot be served as asked; ``status_code`` says why."""

    def __init__(self, status_code: int, message: str) -> None:
        HTTPException.__init__(self, status_code=status_code, detail=message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def bad_request(message: str) -> R3RequestError:
    """400: the request's ``r3`` tag is malformed."""
    return R3RequestError(400, f"r3: {message}")


class CacheUnavailableError(R3RequestError):
    """503: the cache could not be reached (after retries) to look up a rollout."""


def samples_conflict(rollout_id: str) -> R3RequestError:
    """The 409 for n>1 samples naming a rollout that already has stored rows."""
    return R3RequestError(
        409,
        f"r3: rollout {rollout_id!r} already has stored rows, and n>1 samples start "
        "new rollouts; continue each sample with its own request",
    )


class StartupError(RuntimeError):
    """The extension refuses to start: a hook did not take or an option is unsafe."""
