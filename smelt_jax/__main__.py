import sys

from smelt_jax.cli import main

sys.exit(main())
