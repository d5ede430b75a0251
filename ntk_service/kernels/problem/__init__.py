"""A model prepared for the kernel engine: inputs and outputs as batches, the private module, the probe, and the per-
block contexts (eval BatchNorm, embedding padding, math attention) a kernel runs under."""
