"""Logging: structlog calls in the library, stdlib ``logging`` records out of it.

Library code calls :func:`get_logger` and logs structlog-style
(``log.warning("storage_faults", backend="file", eio=3)``). Each logger is a
:class:`structlog.stdlib.BoundLogger` over the stdlib logger ``asynccache.<name>``, with its own
small processor chain: nothing touches structlog's global configuration (importing asynccache
never calls :func:`structlog.configure`), and every event becomes a plain
:class:`logging.LogRecord`, so an application routes, filters and formats asynccache's events
like those of any other library (``logging.getLogger("asynccache").setLevel(...)``, its own
handlers, vLLM's or SGLang's logging set-up).

A record's message is ``event key=value ...`` (readable under any formatter); the event dict
itself rides along as ``record.asynccache_event`` for structured handlers (for structlog's
``ProcessorFormatter``: :func:`lift_event` in ``foreign_pre_chain``). Levels are the stdlib
logger's: disabled events are dropped before anything is formatted. Without any logging set-up,
stdlib's last-resort handler prints WARNING and above to stderr.

Only the command line configures logging (:func:`configure_logging`, for ``--log-level`` /
``--log-format``); a library user never needs to.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

#: Where a record carries its structlog event dict.
EVENT_ATTR = "asynccache_event"
LOG_FORMATS = ("console", "json")


def _to_stdlib(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Last processor: the event dict -> ``logger.<method>(message, extra=..., exc_info=...)``."""
    kwargs: dict[str, Any] = {}
    exc_info = event_dict.pop("exc_info", None)
    if exc_info:
        kwargs["exc_info"] = exc_info
    if event_dict.pop("stack_info", False):
        kwargs["stack_info"] = True
    fields = " ".join(f"{k}={v!r}" for k, v in event_dict.items() if k != "event")
    event = str(event_dict.get("event", ""))
    kwargs["extra"] = {EVENT_ATTR: dict(event_dict)}
    return ((f"{event} {fields}" if fields else event),), kwargs


_PROCESSORS = [structlog.stdlib.filter_by_level, _to_stdlib]


def get_logger(name: str) -> Any:
    """A structlog logger over the stdlib logger ``asynccache.<name>`` (a name that already
    starts with ``asynccache`` is kept as it is)."""
    if name != "asynccache" and not name.startswith("asynccache."):
        name = f"asynccache.{name}"
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        cache_logger_on_first_use=True,
    )


def lift_event(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """A ``ProcessorFormatter`` ``foreign_pre_chain`` step: an asynccache record's event dict
    replaces the one built from its message (other records pass unchanged)."""
    record = event_dict.get("_record")
    lifted = getattr(record, EVENT_ATTR, None)
    if not isinstance(lifted, dict):
        return event_dict
    out = {"event": lifted.get("event"), **lifted}  # the event first in rendered output
    for key in ("_record", "_from_structlog", "exc_info", "stack_info"):
        if key in event_dict:
            out[key] = event_dict[key]
    return out


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(level: int | str = "WARNING", *, fmt: str = "console") -> None:
    """Set up logging for a program (the ``asynccache`` command line): one stderr handler on the
    root logger rendering ``console`` lines or ``json`` objects, the root level, and structlog
    routed through stdlib (so that structlog loggers of other code render the same way).
    Idempotent: calling it again replaces the handler it installed. Libraries never call it."""
    if isinstance(level, str):
        value = logging.getLevelName(level.upper())
        if not isinstance(value, int):
            raise ValueError(f"unknown log level {level!r}")
        level = value
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(LOG_FORMATS)})")
    shared: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        tail: list[Any] = [structlog.processors.format_exc_info]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        tail = []
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[lift_event, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
