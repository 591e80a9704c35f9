"""An answer's text as it is decoded: pieces that never split a UTF-8 character, cut at stop strings.

``StopText`` wraps ``chat.TextStream``: each new token adds the text it completes; text that could
still become the start of a stop string is held back until the next token decides; a stop string
ends the answer and neither it nor anything after it is sent (OpenAI's ``stop``).
"""

from __future__ import annotations

from typing import Any

from engine.inference.chat import TextStream


class StopText:
    """The text of one answer, piece by piece; ``stopped`` once a stop string appeared."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = ()) -> None:
        self.stream = TextStream(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # the longest tail held back
        self.pending = ""  # decoded, not sent yet
        self.stopped = False

    def _cut(self) -> str:
        """Send what is pending up to a stop string (and stop), or all but the held-back tail."""
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            piece, self.pending = self.pending[: min(found)], ""
            return piece
        # hold back the longest tail that a stop string starts with
        held = next(
            (
                k
                for k in range(min(self.hold, len(self.pending)), 0, -1)
                if any(s.startswith(self.pending[-k:]) for s in self.stops)
            ),
            0,
        )
        cut = len(self.pending) - held
        piece, self.pending = self.pending[:cut], self.pending[cut:]
        return piece

    def add(self, token: int) -> str:
        """The new text ``token`` lets through (may be empty)."""
        if self.stopped:
            return ""
        self.pending += self.stream.add(token)
        return self._cut()

    def rest(self) -> str:
        """What is left at the end of the answer (up to a stop string, if one completes there)."""
        if self.stopped:
            return ""
        self.pending += self.stream.rest()
        piece = self._cut()
        if not self.stopped:
            piece, self.pending = piece + self.pending, ""
        return piece
