"""Drop cursors the service answered, and only those (docs/service.md, "Lifecycle").

A drop by weight version stops after a bounded step and answers where its walk stands: the
index of the Redis primary it scans and that primary's ``SCAN`` cursor.  The next call
resumes there.  A client could otherwise write any position (``0.12345``) and have the
service resume a ``SCAN`` at a cursor Redis never returned, so the answer carries a tag:
``<node>.<scan>.<tag>``, the tag the first 16 bytes of HMAC-SHA256 under the store's
``cursor_secret`` over the namespace's key prefix, the walk's ``upto`` and the position.  A
cursor not issued under that secret, or issued for another namespace or another weight
version, is refused.  The secret is a store setting, the same on every replica of the
service, so any replica resumes a walk another one answered.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from r3_client import InvalidRequestError

__all__ = ["MAX_NODE", "issue", "parse"]

#: The highest primary index a cursor names (a Cluster has at most 16,384 masters; the
#: walk ends at the first index past the last one).
MAX_NODE = 9999
_TAG_BYTES = 16
#: Canonical decimals (no leading zeros: one position, one spelling) and a lowercase tag.
_FORM = re.compile(r"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,19})\.([0-9a-f]{32})")


def _tag(secret: bytes, namespace: str, upto: int, node: int, scan: int) -> str:
    msg = f"r3-drop-cursor\0{namespace}\0{upto}\0{node}\0{scan}".encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()[:_TAG_BYTES].hex()


def issue(secret: bytes, namespace: str, upto: int, node: int, scan: int) -> str:
    """The cursor a drop of ``namespace`` (the store's key prefix) up to ``upto`` answers
    to resume at primary ``node``, ``SCAN`` cursor ``scan``."""
    if not 0 <= node <= MAX_NODE or not 0 <= scan < 1 << 64:
        raise ValueError(f"no cursor for node {node}, SCAN cursor {scan}")
    return f"{node}.{scan}.{_tag(secret, namespace, upto, node, scan)}"


def parse(secret: bytes, namespace: str, upto: int, cursor: str) -> tuple[int, int]:
    """``(node, scan)`` of a cursor :func:`issue` answered for this ``namespace`` and
    ``upto``; :class:`InvalidRequestError` for any other (malformed, forged, another
    namespace's, another weight version's, or under another secret)."""
    shown = repr(cursor[:40])
    m = _FORM.fullmatch(cursor)
    if m is None or int(m.group(2)) >= 1 << 64:
        raise InvalidRequestError(
            f"cursor {shown} is not one a drop answered: pass the answer's cursor, or none to start"
        )
    node, scan = int(m.group(1)), int(m.group(2))
    if not hmac.compare_digest(m.group(3), _tag(secret, namespace, upto, node, scan)):
        raise InvalidRequestError(
            f"cursor {shown} is not one this service answered to a drop of this namespace "
            f"up to weight version {upto}: pass the last answer's cursor with the same "
            "upto, or none to start over"
        )
    return node, scan
