"""Whether a request carries an r3 tag: what the HTTP process (tagging, statuses) and the
scheduler (which requests' rows to keep) both ask of every request.

At the root, beside ``config`` and ``errors``, so both process packages import it downward
(issue 44: the scheduler's ``row_hooks`` took it from ``http_server.tagging``, across the
process grouping).  The tag's full rules are :mod:`sglang_r3.http_server.tagging`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["carries_tag"]


def carries_tag(custom_params: Any) -> bool:
    """Whether a request's ``custom_params`` carries an r3 tag: the one answer to "is this
    request tagged?", cheap enough for every request (the tag is checked later)."""
    return isinstance(custom_params, Mapping) and "r3" in custom_params
