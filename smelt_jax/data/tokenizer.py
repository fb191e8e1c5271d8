"""The byte-level tokenizer: 256 byte tokens plus BOS / EOS / PAD, no vocabulary file, no download.

Token ids 0..255 are the UTF-8 bytes themselves, so any text (or binary) round-trips exactly and the
tokenizer needs nothing but this module. Three specials follow the bytes. The vocabulary is padded to
512 (the next multiple of 128 above 259): embedding and output matrices then tile cleanly onto the
128-wide TPU MXU / vector lanes and GPU tensor-core tiles, at a cost of 253 never-used rows (about
130K parameters at d_model 512 — nothing next to the models of the grid).

The tokenizer is versioned together with the corpus (`TOKENIZER_VERSION` is written to the corpus
manifest): any change to ids or specials must bump it, and a corpus built with another version is
refused on load.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from smelt_jax.platform.errors import UsageError

TOKENIZER_VERSION = "bytes-v1"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Bytes are ids 0..255; BOS, EOS, PAD follow; `vocab_size` rounds up to a multiple of 128."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 512
    version: str = TOKENIZER_VERSION

    def __post_init__(self) -> None:
        specials = (self.bos_id, self.eos_id, self.pad_id)
        if len(set(specials)) != 3 or min(specials) < 256:
            raise UsageError(f"special ids {specials} must be distinct and >= 256 (0..255 are bytes)")
        if self.vocab_size <= max(specials) or self.vocab_size > 2**16:
            raise UsageError(f"vocab_size {self.vocab_size} must exceed the specials and fit uint16")

    def encode(self, text: str | bytes) -> np.ndarray:
        """UTF-8 bytes of `text` as token ids: uint16 [len(bytes)]."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_document(self, text: str | bytes) -> np.ndarray:
        """BOS + bytes + EOS: how a document is stored in the corpus. uint16 [len(bytes) + 2]."""
        body = self.encode(text)
        out = np.empty(body.size + 2, dtype=np.uint16)
        out[0], out[-1] = self.bos_id, self.eos_id
        out[1:-1] = body
        return out

    def decode(self, ids) -> str:
        """Bytes back to text; specials are dropped, invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT_TOKENIZER = ByteTokenizer()
