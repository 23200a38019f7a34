"""Which streamed chunks the router counts as carrying a token (its TTFT end and last-token time)."""
from __future__ import annotations

from pdtrace.connector.lab.router import _chunk_has_token


def test_completion_chunk_with_empty_text_is_a_token():
    # a first token ending inside a multi-byte character detokenizes to "" (seen with vllm bench serve)
    assert _chunk_has_token({"choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]})
    assert _chunk_has_token({"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]})


def test_chunks_without_a_token():
    assert not _chunk_has_token({"choices": [], "usage": {"completion_tokens": 5}})  # trailing usage chunk
    assert not _chunk_has_token({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not _chunk_has_token({"error": {"message": "x"}})


def test_chat_chunks():
    assert _chunk_has_token({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert _chunk_has_token({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    assert _chunk_has_token({"choices": [{"index": 0, "delta": {"content": ""},
                                           "logprobs": {"content": [{"token": "\\xe4"}]}}]})
