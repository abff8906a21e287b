"""Text from others made safe to show on a terminal or in a log line.

Titles, messages, task and schedule text, a webhook's reason phrase: whatever a principal
or a peer wrote may hold control characters that clear a screen, move the cursor, set a
terminal's title, forge a log line (a newline) or reverse what follows (a bidi override).
`escape` shows each of them as a `\\uXXXX` escape instead: C0 controls (but those `keep`
names), DEL, C1 controls, and the bidi embeddings, overrides and isolates. Inside a JSON
string `\\uXXXX` is the same character again, so JSON stays valid and means the same.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape(text: str, keep: str = "") -> str:
    """`text` with every unsafe character but those in `keep` shown as `\\uXXXX`."""
    return _UNSAFE.sub(lambda m: m[0] if m[0] in keep else f"\\u{ord(m[0]):04x}", text)


def is_safe(text: str, keep: str = "") -> bool:
    """Whether `text` holds no unsafe character but those in `keep`."""
    return all(found in keep for found in _UNSAFE.findall(text))
