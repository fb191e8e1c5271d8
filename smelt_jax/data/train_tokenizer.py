"""`smelt data tokenizer train`: a byte-level BPE (hf_tokenizer.train_bpe) over the good texts of input
shards read as `smelt data prepare` reads them (JSONL, Parquet, .txt/.md files). Input with no usable
document is refused (TokenizerError, naming the problems and the fields found), never a tokenizer of
bytes alone."""

from __future__ import annotations

import itertools
from collections import Counter

from smelt_jax.platform import storage as gcs
from smelt_jax.data.hf_tokenizer import HFTokenizer, TokenizerError, train_bpe
from smelt_jax.data.input_checks import no_documents_message
from smelt_jax.data.input_shards import INPUT_SUFFIXES, PrepareConfig, iter_texts


def train_on_inputs(inputs: list[str], vocab_size: int, *, text_field: str = "text",
                    max_documents: int | None = None, max_bytes: int | None = None,
                    min_frequency: int = 2) -> tuple[HFTokenizer, Counter]:
    """(the trained tokenizer, bad records skipped by kind)."""
    urls = gcs.expand(inputs, INPUT_SUFFIXES)
    problems: Counter = Counter()
    fields: dict[str, str] = {}
    texts = iter_texts(urls, PrepareConfig(text_field=text_field, default_source="-"),
                       max_documents=max_documents, max_bytes=max_bytes, problems=problems, fields=fields)
    first = next(texts, None)
    if first is None:
        records = problems.pop("records", 0)
        raise TokenizerError(no_documents_message(problems, fields, inputs=len(urls), records=records,
                                                  text_field=text_field,
                                                  prefix="no documents to train a tokenizer on"))
    tokenizer = train_bpe(itertools.chain([first], texts), vocab_size, min_frequency=min_frequency)
    problems.pop("records", None)
    return tokenizer, problems
