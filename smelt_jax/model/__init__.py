"""The SMELT model in Flax NNX: `from smelt_jax.model import Decoder`."""

from smelt_jax.model.decode import (
                                    cache_entries_per_token,
                                    decode_step,
                                    extend,
                                    greedy_decode,
                                    init_cache,
                                    prefill,
)
from smelt_jax.model.decoder import Decoder, stack_layers
from smelt_jax.model.layer import Layer

__all__ = ["Decoder", "Layer", "cache_entries_per_token", "decode_step", "extend", "greedy_decode",
           "init_cache", "prefill", "stack_layers"]
