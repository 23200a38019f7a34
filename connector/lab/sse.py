"""Incremental decoding of an OpenAI-style server-sent-event stream (``data: {json}`` events).

Used by the router (reading D's stream) and the replay client (reading the
router's stream), so both parse the same way.
"""
from __future__ import annotations

import json


class SSEDecoder:
    """Feed raw bytes as they arrive; get back the JSON objects of every complete event.

    Non-``data:`` lines and payloads that are not JSON are skipped; a partial
    event is kept until the bytes that complete it arrive. ``data: [DONE]``
    yields nothing but sets :attr:`done`: an OpenAI stream ends with it, so a
    stream whose bytes stop before it was cut short (the engine died, or a
    connection in between closed), even when no exception was raised.
    """

    def __init__(self) -> None:
        self._buf = b""
        #: True once the ``data: [DONE]`` event was decoded (the stream ended normally).
        self.done = False

    def events(self, data: bytes) -> list[tuple[bytes, list]]:
        """Append ``data``; return ``(raw, payloads)`` for every event it completed, in order.

        ``raw`` is the event's bytes with its closing blank line (what a relay
        writes to pass the event on whole); ``payloads`` the decoded JSON of its
        ``data:`` lines (empty for ``[DONE]``, which sets :attr:`done`, and for
        events that carry no JSON).
        """
        self._buf += data
        out = []
        while b"\n\n" in self._buf:
            ev, self._buf = self._buf.split(b"\n\n", 1)
            payloads = []
            for line in ev.split(b"\n"):
                if line == b"data: [DONE]":
                    self.done = True
                    continue
                if not line.startswith(b"data: "):
                    continue
                try:
                    payloads.append(json.loads(line[6:]))
                except ValueError:
                    continue
            out.append((ev + b"\n\n", payloads))
        return out

    def feed(self, data: bytes) -> list:
        """Append ``data``; return the decoded payloads of the events it completed, in order."""
        return [obj for _, payloads in self.events(data) for obj in payloads]


def finish_reasons(obj: dict) -> set:
    """The ``finish_reason`` values of a decoded chunk's choices (``None`` for an unfinished choice)."""
    return {c.get("finish_reason") for c in obj.get("choices") or () if isinstance(c, dict)}
