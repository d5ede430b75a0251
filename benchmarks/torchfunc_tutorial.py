"""The torch.func tutorial's empirical NTK by Jacobian contraction, written exactly as the tutorial does it.

Source: https://pytorch.org/tutorials/intermediate/neural_tangent_kernels.html
(``empirical_ntk_jacobian_contraction``): ``functional_call`` on detached ``named_parameters()``, per-example
Jacobians by ``vmap(jacrev(fnet_single), (None, 0))``, each flattened to (N, k, P_i), one einsum per parameter
tensor, stacked and summed. No chunking: both Jacobians, (N + M)·k·P floats, live in memory at once; that is
the baseline our ``jacobian_contraction`` must never be slower than.

``compute`` follows the tutorial: 'full' (N, M, k, k), 'trace' (N, M) (the plain sum over outputs), and
'diagonal', which is the tutorial's *output* diagonal (N, M, k), our ``output_diagonal``, not our
``example_diagonal``.

Run as a script: times the tutorial on the benchmark models, and with ``--check-peer`` compares its full
kernel with neural-tangents' on the same weights (needs ``make peer-venv``)::

    .venv/bin/python benchmarks/torchfunc_tutorial.py --models mlp cnn --sizes 64 256
    .venv/bin/python benchmarks/torchfunc_tutorial.py --check-peer
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

_EINSUM = {"full": "Naf,Mbf->NMab", "trace": "Naf,Maf->NM", "diagonal": "Naf,Maf->NMa"}


def tutorial_ntk(
    model: nn.Module,
    x1: Any,
    x2: Any,
    compute: str = "full",
    select: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tutorial's ``empirical_ntk_jacobian_contraction(fnet_single, params, x1, x2, compute)``.

    Args:
        model: the network; called on a batch of one example per Jacobian.
        x1: (N, *input) first inputs; or a dict of them, forward's keyword arguments (a Hugging Face model), each
            example passed as a batch of one as the tutorial passes a tensor.
        x2: (M, *input) second inputs, the same kind.
        compute: 'full', 'trace' or 'diagonal' (the tutorial's output diagonal). Default: 'full'.
        select: what of forward's return value the kernel is of, (1, *out) -> e.g. ``lambda o: o.logits[:, -1]``.
            Default: None (forward returns it).

    Returns:
        theta: (N, M, k, k) for 'full'; (N, M) for 'trace'; (N, M, k) for 'diagonal'.
    """
    if compute not in _EINSUM:
        raise ValueError(f"tutorial_ntk: compute must be one of {sorted(_EINSUM)}, got {compute!r}")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def fnet_single(params, x):
        if select is None and not isinstance(x, dict):  # the tutorial's own line
            return functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)
        if isinstance(x, dict):  # keyword inputs: the same batch of one per leaf
            out = functional_call(model, params, (), {k: v.unsqueeze(0) for k, v in x.items()})
        else:
            out = functional_call(model, params, (x.unsqueeze(0),))
        return (out if select is None else select(out)).reshape(-1)

    # Compute J(x1)
    jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
    jac1 = jac1.values()
    jac1 = [j.flatten(2) if j.ndim > 2 else j.unsqueeze(-1) for j in jac1]  # a 0-d parameter: (N, k, 1)

    # Compute J(x2)
    jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
    jac2 = jac2.values()
    jac2 = [j.flatten(2) if j.ndim > 2 else j.unsqueeze(-1) for j in jac2]

    # Compute J(x1) @ J(x2).T
    einsum_expr = _EINSUM[compute]
    result = torch.stack([torch.einsum(einsum_expr, j1, j2) for j1, j2 in zip(jac1, jac2, strict=True)])
    result = result.sum(0)
    return result


def time_tutorial(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, compute: str, repeats: int) -> float:
    """Median seconds of ``tutorial_ntk`` over ``repeats`` runs after one warm-up run."""
    tutorial_ntk(model, x1, x2, compute)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tutorial_ntk(model, x1, x2, compute)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _check_peer(models: Sequence[str], n: int) -> None:
    from _models import MODELS, make_inputs
    from _peer import check_peer_kernel

    for name in models:
        model = MODELS[name]()
        x1, x2 = make_inputs(name, n), make_inputs(name, n + 1, seed=2)
        theta = tutorial_ntk(model, x1, x2)
        errors = check_peer_kernel(model, x1, x2, theta)
        for implementation, rel in errors.items():
            print(f"{name}: tutorial vs neural-tangents {implementation}: max|diff|/max|theta| = {rel:.2e}")


def main(argv: Sequence[str] | None = None) -> None:
    from _models import MODELS, make_inputs

    parser = argparse.ArgumentParser(description="Time the torch.func tutorial's empirical NTK.")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256], help="N = M values")
    parser.add_argument("--compute", default="full", choices=sorted(_EINSUM))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-peer", action="store_true", help="compare with neural-tangents instead")
    parser.add_argument("--check-n", type=int, default=8, help="N for --check-peer (M = N + 1)")
    args = parser.parse_args(argv)
    if args.check_peer:
        _check_peer(args.models, args.check_n)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        model = MODELS[name]()
        for n in args.sizes:
            x1, x2 = make_inputs(name, n), make_inputs(name, n, seed=2)
            seconds = time_tutorial(model, x1, x2, args.compute, args.repeats)
            print(f"{name} N=M={n} compute={args.compute}: {seconds:.3f} s (median of {args.repeats})")


if __name__ == "__main__":
    main()
