"""`bpcompile serve`'s logs as a platform collects them: on stderr (tritonserver's and bpcompile's, one stream, in
order), plain text or one JSON object per line (`--log-format json`).

tritonserver 2.51 writes text only (`--log-format` is "default" or "ISO8601"): its lines are read from a pipe and,
in JSON, re-emitted with its own fields (level, pid, source file:line, message) and the time they were read
(its default prefix has no year; ISO8601's has no sub-second part). bpcompile's own messages go through the
`logging` module, whose root handler writes the same JSON objects, so other libraries' loggers in the serve
process come out in the same format.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from datetime import datetime, timezone
from typing import Optional

FORMATS = ("text", "json")
# tritonserver's default prefix: level letter, MMDD hh:mm:ss.micro, thread/pid, file:line] message
TRITON_LINE = re.compile(r"^([IWEV])\d{4} \d\d:\d\d:\d\d\.\d+ +(\d+) ([^\]\s]+)\] ?(.*)$")
TRITON_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "V": "DEBUG"}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def json_line(level: str, logger: str, message: str, t: Optional[float] = None, **fields) -> str:
    return json.dumps(
        {"time": _iso(time.time() if t is None else t), "level": level, "logger": logger, "message": message, **fields},
        ensure_ascii=False,
    )


class TritonLines:
    """tritonserver's log lines as JSON lines. A line without the prefix (a table row, a multi-line message's
    continuation) keeps the level of the line before it."""

    def __init__(self):
        self.level = "INFO"

    def __call__(self, line: str) -> str:
        line = line.rstrip("\r\n")
        m = TRITON_LINE.match(line)
        if not m:
            return json_line(self.level, "tritonserver", line)
        letter, pid, source, message = m.groups()
        self.level = TRITON_LEVELS[letter]
        if len(message) >= 2 and message[0] == message[-1] == '"':  # 2.51 quotes and escapes its messages
            try:
                message = json.loads(message)
            except ValueError:
                pass
        return json_line(self.level, "tritonserver", message, pid=int(pid), source=source)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return json_line(record.levelname, record.name, message, record.created)


def configure(fmt: str, stream=None) -> logging.Logger:
    """The root logger on `stream` (default stderr) in `fmt`; returns the logger serve writes to."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    return logging.getLogger("bpcompile.serve")
