"""The server's log: every line on stderr, in one format — uvicorn's own lines, the access lines, the
runtime's (engine failures, aborts at shutdown) and the start-up and shutdown lines alike — as text
(uvicorn's level prefix: `INFO:     message`) or, with `--log-format json`, as one JSON object a line
for machines: time (UTC, ISO 8601), level, logger, message, and for an access line its fields
(client, method, path, http_version, status).

stdout is left to nothing: before this, uvicorn wrote its access lines there and everything else to
stderr, so a log collected from one stream missed half of it.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")  # uvicorn.access's record.args, in order
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "qruntime")


class JSONFormatter(logging.Formatter):
    """One JSON object per record (ensure_ascii off: a path or message in any script stays readable)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            body.update(zip(ACCESS_FIELDS, record.args, strict=True))
        body.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False, default=str)


def log_config(log_format: str, level: str) -> dict[str, Any]:
    """uvicorn's log_config (logging.config.dictConfig) for `log_format` at `level`: every logger the
    server writes through, on stderr, in that format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if log_format == "json":
        formatters = {name: {"()": f"{__name__}.JSONFormatter"} for name in ("default", "access")}
    else:
        formatters = {
            "default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(message)s"},
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s',
            },
        }
    handlers = {
        name: {"formatter": name, "class": "logging.StreamHandler", "stream": "ext://sys.stderr"}
        for name in ("default", "access")
    }
    level = level.upper()
    loggers = {
        "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
        "uvicorn.error": {"level": level},
        "uvicorn.access": {"handlers": ["access"], "level": level, "propagate": False},
        "qruntime": {"handlers": ["default"], "level": level, "propagate": False},
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": formatters,
        "handlers": handlers,
        "loggers": loggers,
    }


def announce(message: str, log_format: str, stream: TextIO, **fields: Any) -> None:
    """A start-up or shutdown line in the log's format, whatever the log level (it says the server
    is loaded, or where it listens: what a supervisor waits for)."""
    record = logging.LogRecord("qruntime.serve", logging.INFO, __file__, 0, message, None, None)
    record.fields = fields
    formatter = JSONFormatter() if log_format == "json" else _text_formatter()
    print(formatter.format(record), file=stream, flush=True)


def _text_formatter() -> logging.Formatter:
    from uvicorn.logging import DefaultFormatter

    return DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False)
