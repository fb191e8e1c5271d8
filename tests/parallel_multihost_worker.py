"""One process of the two-process test (tests/test_parallel_multihost.py); not a test module.

argv: port process_id corpus_dir root layout"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

port, process_id, corpus_dir, root, layout = sys.argv[1:6]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=int(process_id))

from pathlib import Path

from smelt_jax.data.token_store import TokenStore
from smelt_jax.parallel.layout import parse_layout
from smelt_jax.train.trainer import train
from tests.test_parallel_multihost import OPTIONS, micro_run

assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
summary = train(micro_run(), root=Path(root), corpus=TokenStore(corpus_dir), options=OPTIONS,
                parallelism=parse_layout(layout))
print("DONE", summary)
