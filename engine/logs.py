"""Where the engine's structured logs go. An application that configures structlog itself keeps
its configuration; otherwise the engine logs INFO and above to stderr (structlog's own default
would print every debug line, one per preemption, to stdout)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: int) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
    )


def configure_default() -> None:
    if not structlog.is_configured():
        configure(logging.INFO)


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    """Looks sys.stderr up when a logger is made, so a replaced stderr (tests) is followed."""
    return structlog.PrintLogger(file=sys.stderr)
