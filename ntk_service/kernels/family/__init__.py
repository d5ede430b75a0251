"""The kernel family beside the NTK: NNGP and conjugate kernels, Monte Carlo averages over initializations, the pseudo-
NTK, per-group kernels."""
