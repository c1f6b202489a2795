"""Tokenizers: Kimi's tiktoken encoding, read from ``tiktoken.model`` in the model directory
(tiktoken is an optional extra), and the byte tokenizer preset (random) models use."""

from __future__ import annotations

from pathlib import Path

# Kimi's pre-tokenizer split pattern
PATTERN = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&"
           r"[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
           r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerError(ValueError):
    pass


class ByteTokenizer:
    """Preset models' text: UTF-8 bytes are token ids 0-255; ids >= 256 decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def kimi_tokenizer(directory: Path):
    """The tiktoken ``Encoding`` of ``directory/tiktoken.model`` (``TokenizerError`` naming the file
    when it is absent, or the package when tiktoken is not installed)."""
    model_file = Path(directory) / "tiktoken.model"
    if not model_file.exists():
        raise TokenizerError(f"text prompts need Kimi's tokenizer: {model_file} not found (use {{\"ids\": [...]}})")
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError:
        raise TokenizerError("text prompts need tiktoken: pip install tiktoken") from None
    ranks = load_tiktoken_bpe(str(model_file))
    return tiktoken.Encoding(name="kimi", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
