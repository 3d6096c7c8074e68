"""Logging for the daemons: one line per record, as text or as JSON objects.

``setup_logging`` configures the root logger once per process. Text lines
read ``time level logger: message``; JSON lines carry ``time``, ``level``,
``logger`` and ``message`` (and ``error`` with the exception's one line when
there is one), so a log shipper needs no parsing rules. Never raises for a
valid format and level.
"""

from __future__ import annotations

import json
import logging
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {"time": round(record.created, 3), "level": record.levelname,
                                  "logger": record.name, "message": record.getMessage()}
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            out["error"] = f"{type(err).__name__}: {err}"
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    """Send every record at ``level`` and above to stderr in ``fmt`` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
