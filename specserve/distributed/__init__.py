"""Tensor parallelism: a decoder split over ranks (torch.distributed process groups), driven by the engine.

The engine's process is rank 0 (the driver): it schedules, samples and drafts, and broadcasts each step's
inputs to the workers (local processes or Ray actors), which run the same forward on their shards.
"""
