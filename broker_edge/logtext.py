"""Text a client chose (client id, user name, topic), made safe to write where we log it.

Two places take it: the edge's own log lines, where a newline or other control character in a
client id would forge a line (:func:`printable` escapes them), and the journaled log events of
the operator's namespace, which a client that never authenticated can fill (:func:`truncated`
caps what each record keeps).
"""

from __future__ import annotations

import re

# How much of a client-chosen string a log line or an operator log event keeps.
MAX_CLIENT_TEXT = 256
TRUNCATION_MARKER = "…[truncated]"

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the backslash itself
# (so an escaped sequence cannot be told apart from one the client typed).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\\\\]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return (
        "\\\\"
        if char == "\\"
        else f"\\x{ord(char):02x}"
        if ord(char) < 256
        else f"\\u{ord(char):04x}"
    )


def truncated(text: str, limit: int = MAX_CLIENT_TEXT) -> str:
    """``text``, or its first ``limit`` characters and a marker saying it was cut."""
    return text if len(text) <= limit else text[:limit] + TRUNCATION_MARKER


def printable(text: str, limit: int = MAX_CLIENT_TEXT) -> str:
    """``text`` truncated and with every control character escaped: one log line stays one."""
    text = truncated(text, limit)
    if text.isprintable() and "\\" not in text:
        return text
    return _UNSAFE.sub(_escape, text)
