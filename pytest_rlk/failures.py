"""Why a test failed, kept in the run file (``TestRecord.failure``): a run that died, or a log
that was cut, still says it. Plain functions over pytest's report attributes (duck-typed)."""
from __future__ import annotations

TAIL_LINES = 40
MAX_CHARS = 4000


def failure_message(crash: str | None, longrepr_text: str, *, tail_lines: int = TAIL_LINES,
                    max_chars: int = MAX_CHARS) -> str:
    """The crash line, then the last ``tail_lines`` lines of the long report, at most
    ``max_chars`` characters: the tail loses its beginning first (the end names the error)."""
    crash = (crash or "").strip()
    lines = longrepr_text.rstrip().splitlines()
    tail = "\n".join(lines[-tail_lines:])
    if len(lines) > tail_lines:
        tail = f"[... {len(lines) - tail_lines} lines cut ...]\n" + tail
    head = crash[:max_chars // 4]
    room = max_chars - len(head) - 1
    if len(tail) > room:
        tail = "[...]" + tail[len(tail) - room + 5:]
    return f"{head}\n{tail}" if head and tail else head or tail


def report_failure(report) -> str | None:
    """The message of a failed pytest ``TestReport`` (None when it did not fail)."""
    if not report.failed:
        return None
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    return failure_message(crash, report.longreprtext)
