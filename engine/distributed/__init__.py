"""Tensor parallelism: one process per GPU (or per gloo rank on CPU), the scheduler on rank 0 only."""
