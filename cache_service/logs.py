"""Structured (JSON lines) logging for the service."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["configure_logging", "log_event"]

logger = logging.getLogger("r3.cache")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any ``extra={"r3": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "r3", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Route ``r3.*`` and uvicorn logs to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("r3", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # we log requests ourselves


def log_event(msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields``."""
    logger.log(level, msg, extra={"r3": fields})
