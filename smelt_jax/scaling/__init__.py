"""Scaling-law fits of run tables: laws, robust vectorised fitting, cell bootstrap, frontier and CE gains,
tables and figures. Imports no model or training code."""

from smelt_jax.scaling.laws import (
    LAWS,
    ChinchillaLaw,
    LoopedLaw,
    SmeltLaw,
    law_from_dict,
)

__all__ = ["LAWS", "ChinchillaLaw", "LoopedLaw", "SmeltLaw", "law_from_dict"]
