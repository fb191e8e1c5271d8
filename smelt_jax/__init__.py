"""smelt_jax: compute-matched Mixture-of-Experts looped transformers (SMELT) in JAX."""

__version__ = "0.1.0"
