"""structlog set up once for the whole package.

Library code calls :func:`get_logger`; nothing prints. Applications may call
:func:`configure_logging` themselves; otherwise it runs with defaults on first use.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(level: int | str = "WARNING", *, json: bool = False) -> None:
    """Configure structlog (key=value lines on stderr by default). Idempotent."""
    global _configured
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            raise ValueError(f"unknown log level {level!r}")
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.processors.KeyValueRenderer(
            key_order=["event"], sort_keys=True
        )
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> Any:
    """Return a structlog logger bound to ``component=name``."""
    if not _configured:
        configure_logging()
    return structlog.get_logger().bind(component=name)
