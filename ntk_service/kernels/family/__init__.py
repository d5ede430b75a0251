"""The kernel family beside the NTK, built on the engine (above ``api.py``): NNGP and conjugate kernels
(``nngp.py``), Monte Carlo averages over initializations (``monte_carlo.py``).

The per-group kernels' parameter groups and the pseudo-NTK's derived model are engine primitives:
``kernels/groups.py`` and ``kernels/derived.py`` (``family.groups`` and ``family.pseudo`` are deprecated aliases).
"""
