"""A byte-level BPE tokenizer trained here with the `tokenizers` library (no download)."""

from __future__ import annotations

from pathlib import Path

from weightstream.data.corpus import read_texts


def train_bpe(directory: Path, vocab_size: int) -> Path:
    """Train on the standard library's text; save ``directory/tokenizer.json``; return it."""
    import tokenizers

    text = b"\n".join(read_texts(max_bytes=2**20)).decode("utf-8", errors="replace")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path
