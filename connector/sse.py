"""Incremental decoding of an OpenAI-style server-sent-event stream (``data: {json}`` events).

Used by the API-server middleware (whether a chunk the engine wrote carries a
token, :mod:`pdtrace.connector.traced.middleware`), the lab router (reading D's
stream) and the replay client (reading the router's stream: its decoder and
finish reasons; it counts tokens from usage). Nothing here keeps a payload:
callers read a chunk's token presence and finish reason, never its text.
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

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished event wait for the rest."""
        return bool(self._buf)

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


#: Finish reasons that end a response the engine gave up on rather than completed: vLLM's
#: ``FINISHED_ABORTED`` ("abort": engine shutdown, sleep or scale-down pause, an abort request;
#: vllm-project/vllm#57082, #45520) and ``FINISHED_ERROR`` ("error": e.g. the KV load failed).
GAVE_UP = ("abort", "error")


def chunk_has_token(obj: dict) -> bool:
    """True if a response chunk (parsed JSON, a streamed chunk or a whole ``stream: false`` body)
    carries at least one generated token.

    Completions: vLLM sends a choice chunk only when it has new tokens (or, after
    the first, a finish), so a ``text`` key counts even when empty: a token that
    ends inside a multi-byte character detokenizes to "" (vLLM's completion stream
    loop skips empty chunks only before the first token). A choice finished with a
    :data:`GAVE_UP` reason and no text is the engine ending the response, not a
    token; for a request aborted before its first token vLLM 0.32 writes no such
    chunk at all, only ``[DONE]`` (vllm-project/vllm#57082). A choice finished with
    any other reason (stop, length, tool calls) had tokens even when none is shown
    (a reasoning parser with reasoning hidden writes nothing before the finish), and
    so has a chunk listing ``token_ids`` (``return_token_ids``). Chat: the first chunk
    announces the role with no token, so only content (even "" in a chunk that
    announces no role: a token ending inside a multi-byte character), reasoning,
    tool calls or logprobs count (``message`` for a whole body).
    """
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        fr = ch.get("finish_reason")
        if fr is not None and fr not in GAVE_UP:
            return True  # finished (stop, length, tool calls): the engine generated tokens, shown or not
        if "text" in ch and (ch["text"] or fr not in GAVE_UP):
            return True
        if ch.get("token_ids"):  # return_token_ids
            return True
        d = ch.get("delta") or ch.get("message") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
            return True
        if "content" in d and "role" not in d and fr not in GAVE_UP:
            return True  # a token ending inside a multi-byte character: content "" (vLLM writes it for token ids)
        lp = ch.get("logprobs")
        if lp and (lp.get("tokens") or lp.get("content")):
            return True
    return False
