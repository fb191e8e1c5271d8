"""The embedded corpus, its byte-level tokenizer, and the deterministic packed input pipeline."""
