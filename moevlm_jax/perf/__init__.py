"""Performance accounting the trainer, the planner and the benchmarks share: model FLOPs and the MFU
denominator (``flops``), the train step's compiled memory and out-of-memory advice (``memory``)."""
