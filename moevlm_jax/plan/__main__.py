"""``python -m moevlm_jax.plan``: the planner's CLI (``moevlm_jax.plan.cli``)."""

import sys

from moevlm_jax.plan.cli import main

sys.exit(main())
