"""Hugging Face tokenizers: load any `tokenizer.json` (local or gs://), or train a byte-level BPE.

The embedded `ByteTokenizer` (smelt_jax/data/tokenizer.py) stays the default; this module adds the
tokenizers a real corpus needs. Both kinds present the interface the corpus, the token store and the
pipeline use: `bos_id`, `eos_id`, `pad_id`, `vocab_size`, `encode_document(text)` (BOS + ids + EOS),
`decode(ids)` and `to_dict()`, plus `sha256` (the identity a token store records and a reader checks)
and `token_dtype` (uint16 up to 65,536 ids, else uint32).

A tokenizer's hash is the sha256 of its canonical JSON: `tokenizer.json` parsed and written back with
sorted keys and no whitespace, so formatting does not change it but any vocabulary, merge, normaliser or
special token does. For the byte tokenizer it is the hash of its `to_dict()`.

Special tokens: a trained BPE gets `<|bos|>`, `<|eos|>`, `<|pad|>` (ids 0, 1, 2). A loaded tokenizer's
specials are looked up by name (`bos=`, `eos=`, `pad=`), else among common spellings (`<s>`, `</s>`,
`<|endoftext|>`, `[PAD]`, ...); a tokenizer with a single end-of-text token uses it for all three.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import numpy as np

from smelt_jax.platform import storage as gcs
from smelt_jax.data.tokenizer import DEFAULT_TOKENIZER, ByteTokenizer
from smelt_jax.platform.errors import SmeltError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
_CANDIDATES = {
    "bos": (BOS, "<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|endoftext|>"),
    "eos": (EOS, "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|endoftext|>"),
    "pad": (PAD, "<pad>", "[PAD]", "<|padding|>", "<|endoftext|>", "</s>"),
}


class TokenizerError(SmeltError, ValueError):
    """A tokenizer file that cannot be read, or lacks the special tokens a document needs."""


def canonical_json(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class HFTokenizer:
    """A `tokenizers.Tokenizer` with BOS / EOS / PAD ids and a content hash."""

    kind = "hf"

    def __init__(self, tokenizer, *, source: str = "<memory>", bos: str | None = None,
                 eos: str | None = None, pad: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.json = canonical_json(tokenizer.to_str())
        self.sha256 = sha256_text(self.json)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        ids = {}
        for role, wanted in (("bos", bos), ("eos", eos), ("pad", pad)):
            names = (wanted,) if wanted else _CANDIDATES[role]
            for name in names:
                index = tokenizer.token_to_id(name)
                if index is not None:
                    ids[role] = (name, int(index))
                    break
            else:
                raise TokenizerError(f"tokenizer {source} has no {role.upper()} token (tried {list(names)}); "
                                     f"name it with --{role}-token")
        (self.bos_token, self.bos_id), (self.eos_token, self.eos_id) = ids["bos"], ids["eos"]
        self.pad_token, self.pad_id = ids["pad"]
        self.token_dtype = token_dtype(self.vocab_size)

    # Loading --------------------------------------------------------------------------------------
    @classmethod
    def from_str(cls, text: str, **kwargs) -> HFTokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_str(text), **kwargs)
        except TokenizerError:
            raise
        except Exception as err:  # the Rust side raises plain Exceptions for malformed files
            raise TokenizerError(f"not a Hugging Face tokenizer.json ({kwargs.get('source', '')}): {err}") \
                from err

    @classmethod
    def from_file(cls, url, **kwargs) -> HFTokenizer:
        """A `tokenizer.json` at a local path or gs:// URL."""
        try:
            text = gcs.read_text(url)
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerError(f"cannot read tokenizer {url}: {err}") from err
        return cls.from_str(text, source=str(url), **kwargs)

    def save(self, url) -> None:
        gcs.write_text(url, self.tokenizer.to_str(pretty=True))

    # Encoding -------------------------------------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.token_dtype)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """BOS + ids + EOS for each text (one batched call into the Rust tokenizer)."""
        out = []
        for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False):
            ids = np.empty(len(encoding.ids) + 2, dtype=self.token_dtype)
            ids[0], ids[-1] = self.bos_id, self.eos_id
            ids[1:-1] = encoding.ids
            out.append(ids)
        return out

    def encode_document(self, text: str) -> np.ndarray:
        return self.encode_documents([text])[0]

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                "bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source}, vocab {self.vocab_size}, sha256 {self.sha256[:12]})"


class BytesTokenizer:
    """The embedded ByteTokenizer seen through the same interface (kind "bytes")."""

    kind = "bytes"

    def __init__(self, base: ByteTokenizer = DEFAULT_TOKENIZER) -> None:
        self.base = base
        self.bos_id, self.eos_id, self.pad_id = base.bos_id, base.eos_id, base.pad_id
        self.vocab_size = base.vocab_size
        self.json = json.dumps(base.to_dict(), sort_keys=True, separators=(",", ":"))
        self.sha256 = sha256_text(self.json)
        self.token_dtype = np.dtype(np.uint16)
        self.source = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return self.base.encode(text)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        return [self.base.encode_document(t) for t in texts]

    def encode_document(self, text: str) -> np.ndarray:
        return self.base.encode_document(text)

    def decode(self, ids) -> str:
        return self.base.decode(ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sha256": self.sha256, **self.base.to_dict()}


def load_tokenizer(spec: str | None, **special_names) -> HFTokenizer | BytesTokenizer:
    """`bytes` (or None) -> the embedded byte tokenizer; anything else -> a tokenizer.json path / URL."""
    if spec in (None, "", "bytes"):
        return BytesTokenizer()
    return HFTokenizer.from_file(spec, **{k: v for k, v in special_names.items() if v})


def tokenizer_from_record(record: dict, json_text: str | None = None):
    """Rebuild the tokenizer a token store's manifest names (its JSON is stored next to it)."""
    if record.get("kind") == "bytes":
        fields = {k: record[k] for k in ("bos_id", "eos_id", "pad_id", "vocab_size", "version")}
        return BytesTokenizer(ByteTokenizer(**fields))
    if json_text is None:
        raise TokenizerError("a Hugging Face tokenizer record needs its tokenizer.json")
    return HFTokenizer.from_str(json_text, source="token store", bos=record.get("bos_token"),
                                eos=record.get("eos_token"), pad=record.get("pad_token"))


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2,
              max_token_length: int | None = 32) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenisation, all 256 bytes in the alphabet) over `texts`.

    Specials `<|bos|>`, `<|eos|>`, `<|pad|>` take ids 0..2; `vocab_size` counts them and the 256 bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 259 + 1:
        raise TokenizerError(f"vocab_size {vocab_size} must exceed 259 (3 specials + 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD], max_token_length=max_token_length,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer, source="trained")
