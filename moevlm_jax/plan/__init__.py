"""The planner: which layout and settings fit a model on N devices, and which is fastest.

Modules (low to high): ``geometry`` (parameter shards per layout), ``memory`` (per-device memory by part),
``comm`` (per-step communication by mesh axis and across hosts), ``time`` (step time, hardware rates),
``search`` (candidates, estimates, ranking), ``fit`` (XLA's compiled check and the train command's
pre-flight ``fit``), ``autofit`` (the train command's ``--auto-fit``), ``report`` (table, CSV/JSON, plot),
``cli`` (``python -m moevlm_jax.plan``), ``compiled`` (``python -m moevlm_jax.plan.compiled``: the run's real step
compiled for a target of N GPUs, XLA's memory and the compiled collectives beside the estimate).
"""
