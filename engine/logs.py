"""Where the engine's structured logs go. An application that configures structlog itself keeps
its configuration; otherwise the engine logs INFO and above to stderr (structlog's own default
would print every debug line, one per preemption, to stdout). Tracebacks print plainly:
structlog's default draws them with rich, every frame's locals included, on the thread that
logs, which is the event loop (8-17 s for a two-frame traceback at load 12 on 2 cores, while
pings and streams waited: tests/cluster/test_heartbeat_logging.py)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: int) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
        processors=[
            structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(), structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback,
                                          colors=_is_tty(sys.stderr))],
    )


def configure_default() -> None:
    if not structlog.is_configured():
        configure(logging.INFO)


def _is_tty(stream: object) -> bool:
    """Colours only on a terminal, as structlog's default decides: a file or a pipe (a test's
    captured stderr, a log collector) gets plain `key=value` text."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    """Looks sys.stderr up when a logger is made, so a replaced stderr (tests) is followed."""
    return structlog.PrintLogger(file=sys.stderr)
