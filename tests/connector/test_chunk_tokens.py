"""Which response chunks count as carrying a token (``pdtrace.connector.sse.chunk_has_token``): the lab router's
TTFT end and last-token time, and the API-server middleware's ``token`` event."""
from __future__ import annotations

from pdtrace.connector.sse import chunk_has_token


def test_completion_chunk_with_empty_text_is_a_token():
    # a first token ending inside a multi-byte character detokenizes to "" (seen with vllm bench serve)
    assert chunk_has_token({"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]})
    assert chunk_has_token({"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]})


def test_chunks_without_a_token():
    assert not chunk_has_token({"choices": [], "usage": {"completion_tokens": 5}})  # trailing usage chunk
    assert not chunk_has_token({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not chunk_has_token({"error": {"message": "x"}})


def test_chat_chunks():
    assert chunk_has_token({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert chunk_has_token({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    assert chunk_has_token({"choices": [{"index": 0, "delta": {"content": ""},
                                          "logprobs": {"content": [{"token": "\\xe4"}]}}]})
    # a token ending inside a multi-byte character: content "" in a chunk that announces no role
    assert chunk_has_token({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]})
    assert chunk_has_token({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})


def test_finished_choices():
    """A choice the engine gave up on (abort / error) with no text is no token (vllm-project/vllm#57082); one
    finished otherwise had tokens even when none is shown (a reasoning parser with reasoning hidden writes only
    the finish), and so has a chunk listing token ids (return_token_ids)."""
    assert not chunk_has_token({"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]})
    assert not chunk_has_token({"choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]})
    assert not chunk_has_token({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}]})
    assert chunk_has_token({"choices": [{"index": 0, "text": "x", "finish_reason": "abort"}]})
    assert chunk_has_token({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert chunk_has_token({"choices": [{"index": 0, "delta": {}, "token_ids": [17], "finish_reason": None}]})
