"""Structured logging: one line per event, `key=value` pairs, the same shape in every service."""
from __future__ import annotations

import logging
import os
import sys


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname[0]} {record.name}: {record.getMessage()}"
        text = f"{base} {extra}" if extra else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    """Configures the root logger once for a service process and returns the service's logger."""
    root = logging.getLogger()
    if not any(getattr(h, "_dockrl", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_KeyValueFormatter())
        handler._dockrl = True
        root.addHandler(handler)
    root.setLevel((level or os.environ.get("DOCKRL_LOG_LEVEL", "INFO")).upper())
    return logging.getLogger(f"dockrl.{service}")


def log_event(logger: logging.Logger, message: str, level: int = logging.INFO, **fields) -> None:
    """Logs `message` with `fields` rendered as key=value pairs."""
    logger.log(level, message, extra={"fields": fields})
