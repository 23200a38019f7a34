"""Model maker: a small random-weight Llama model and a locally trained tokenizer.

No hub downloads work in the lab, so the lab makes its own model, deterministically
from a seed: a ``LlamaForCausalLM`` with random weights saved as safetensors and a
byte-level BPE tokenizer trained with ``tokenizers`` on a seeded synthetic corpus,
wrapped for transformers and given a chat template.

Rules learned on this machine kind (``lab-notes.md``):

- vLLM's CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, ...};
  head_dim 16 starts "healthy" and then kills the engine on the first request.
  :class:`ModelSpec` only accepts 64 or 128.
- The model's vocab size must equal the tokenizer's, or decoded text is junk;
  the maker sets the model's vocab from the trained tokenizer.

The directory is cached by a content hash of the spec (and the maker version), so
the same spec and seed always reuse the same files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from pdtrace.instrument import config

# Bump when the produced files change for the same spec (invalidates caches).
MAKER_VERSION = 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>",
                  "<|system|>", "<|user|>", "<|assistant|>"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Size knobs of the lab model.

    KV bytes per token (bf16) = 2 (K and V) x ``layers`` x ``kv_heads`` x
    ``head_dim`` x 2 bytes; see :attr:`kv_bytes_per_token`.
    """

    hidden: int = 128
    layers: int = 2
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 256
    vocab_target: int = 2048
    max_position: int = 8192
    # Larger than Llama's default (0.02) so that outputs depend visibly on the
    # context: the logprob checks must be able to tell two prompts apart.
    init_std: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.head_dim not in (64, 128):
            raise ValueError(
                f"head_dim = hidden/heads = {self.head_dim}; vLLM's CPU attention in the lab "
                "needs 64 or 128 (head_dim 16 crashes the engine on the first request)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token in bfloat16 (all layers, K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    def digest(self) -> str:
        """Content hash of the spec and maker version (16 hex chars)."""
        blob = json.dumps({"v": MAKER_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Profiles: the default (fast) and one where KV transfers take a visible share.
PROFILES: dict[str, ModelSpec] = {
    "default": ModelSpec(),
    # 16 KiB of KV per token (16x the default) and UCX over TCP (set by the launcher).
    "transfer-heavy": ModelSpec(hidden=512, layers=8, heads=4, kv_heads=4, intermediate=1024),
}


def default_cache_dir() -> Path:
    """``$PDTRACE_LAB_CACHE`` or ``~/.cache/pdtrace/lab``."""
    env = config.raw("PDTRACE_LAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdtrace" / "lab"


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    """A seeded synthetic corpus of pseudo-words (no real text involved)."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "he",
            "da", "fi", "go", "wu", "xi", "yo", "be", "co"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(1500)]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 20)
        line = " ".join(rng.choice(words) for _ in range(n))
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ",", ";"]) + " " + str(rng.randint(0, 999)))
    return lines


def _train_tokenizer(spec: ModelSpec, out: Path) -> int:
    """Train and save the tokenizer into ``out``; return its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position
    fast.save_pretrained(out)
    return len(fast)


def _write_model(spec: ModelSpec, vocab: int, out: Path, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position, initializer_range=spec.init_std,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False,
        torch_dtype="bfloat16")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)
    # The eos token is never the greedy choice by construction: replay lengths are
    # set by max_tokens + ignore_eos anyway, but this keeps plain requests long too.
    with torch.no_grad():
        model.lm_head.weight[eos].zero_()
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def make_model(spec: ModelSpec | str = "default", cache_dir: Path | None = None) -> Path:
    """Create (or reuse) the lab model for ``spec``; return its directory.

    ``spec`` is a :class:`ModelSpec` or a profile name from :data:`PROFILES`.
    The directory is ``<cache_dir>/model-<digest>``; it is built in a temporary
    directory and renamed when complete, so a crash never leaves a half model.
    Takes about 5 s the first time.

    Raises ``KeyError`` for an unknown profile name.
    """
    if isinstance(spec, str):
        spec = PROFILES[spec]
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"model-{spec.digest()}"
    if (final / "pdtrace-model.json").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=cache_dir))
    try:
        vocab = _train_tokenizer(spec, tmp)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tmp)
        _write_model(spec, vocab, tmp, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        (tmp / "pdtrace-model.json").write_text(json.dumps(
            {"maker_version": MAKER_VERSION, "spec": dataclasses.asdict(spec), "vocab_size": vocab,
             "kv_bytes_per_token": spec.kv_bytes_per_token}, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "pdtrace-model.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_info(path: Path) -> dict:
    """The maker's metadata (spec, vocab size, KV bytes per token) of a model directory."""
    return json.loads((Path(path) / "pdtrace-model.json").read_text())
