"""Θ as a matrix-free linear operator: in memory (``ntk_operator``) or over a data set read in chunks
(``dataset_operator``)."""
