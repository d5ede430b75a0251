"""Kernel-target alignment, in the four published variants (no default: the caller names one).

======================= ======================================================== ==============================
variant                 value                                                    from
======================= ======================================================== ==============================
"uncentered"            ⟨K, YYᵀ⟩_F / (‖K‖_F ‖YYᵀ‖_F)                              Cristianini et al. 2001
"centered"              ⟨HKH, HYYᵀH⟩_F / (‖HKH‖_F ‖HYYᵀH‖_F), H = I − 11ᵀ/N        Cortes, Mohri & Rostamizadeh
                        (= biased linear CKA of the features of K and Y)          2012
"centered_vec_y"        vᵀ K_c v / (‖K_c‖_F ‖v‖²), K_c = (H⊗I_k) K (H⊗I_k) on the  Baratin et al. 2021
                        FULL kernel, v = vec(Y − column means)                   (nngeometry centering=True)
"rayleigh"              vec(Y)ᵀ Θ vec(Y) / ‖Y‖²                                   Ortiz-Jiménez et al. 2021
======================= ======================================================== ==============================

K in "uncentered" / "centered" is an (N, N) kernel: a FULL kernel enters as its trace over outputs (these two are
scale-invariant, so sum or mean is the same). "centered_vec_y" and "rayleigh" use the whole FULL kernel; a TRACE
kernel enters as (trace / k) ⊗ I_k (NOTE [layout] in ``layout.py``), k = Y's width; "rayleigh" is the only
variant that depends on that scale.

``y`` is class labels (N,) of an integer dtype (one-hot inside: one column per distinct label, or k columns for
the two FULL-kernel variants, labels in 0..k−1) or targets (N, c) floats (a float (N,) is one target column).

Every sum is over entries, so the kernel streams tile by tile (``tiles.py``): memory is one tile plus O(N·k²).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.layout import to_float64
from ntk_service.analysis.tiles import DEFAULT_BLOCK_ROWS, iter_tiles
from ntk_service.errors import InvalidInput, ShapeMismatch, operation_name

__all__ = ["Variant", "alignment", "as_targets"]

Variant = Literal["uncentered", "centered", "centered_vec_y", "rayleigh"]

VARIANTS: tuple[str, ...] = ("uncentered", "centered", "centered_vec_y", "rayleigh")

_OPERATION = "alignment"


def as_targets(y: Any, *, classes: int | None = None, operation: str = _OPERATION) -> np.ndarray:
    """Float64 (N, c) targets from labels (one-hot) or targets.

    Args:
        y: (N,) integer labels, or (N, c) / (N,) float targets.
        classes: one-hot width for labels (labels must be in 0..classes−1). Default: one column per distinct label.

    Raises:
        InvalidInput: labels out of range, or another rank.
    """
    raw = np.asarray(y.detach().cpu() if is_torch_tensor(y) else y)
    if raw.ndim == 1 and raw.dtype.kind in "iub":
        labels = raw.astype(np.int64)
        if classes is None:
            _, index = np.unique(labels, return_inverse=True)
            width = int(index.max()) + 1 if index.size else 0
        else:
            if labels.size and (labels.min() < 0 or labels.max() >= classes):
                raise InvalidInput(
                    f"{operation}: labels must be in 0..{classes - 1} for a FULL kernel with k = {classes} "
                    f"outputs, got [{labels.min()}, {labels.max()}]; or pass one-hot targets"
                )
            index, width = labels, classes
        onehot = np.zeros((labels.size, width))
        onehot[np.arange(labels.size), index] = 1.0
        return onehot
    array = to_float64(raw, name="y", operation=operation)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2:
        raise InvalidInput(f"{operation}: y has shape {array.shape}; expected labels (N,) or targets (N, c)")
    return array


def alignment(kernel: Any, y: Any, *, variant: Variant | str, block_rows: int = DEFAULT_BLOCK_ROWS) -> float:
    """The alignment of a kernel with targets, in the named ``variant`` (module docstring).

    Args:
        kernel: (N, N, k, k) FULL or (N, N) TRACE (numpy / torch), a stored array read by rows (zarr), or an
            iterable of ``KernelTile(row, col, block)`` covering the kernel once.
        y: labels (N,) of an integer dtype, or targets (N, c).
        variant (str): "uncentered" | "centered" | "centered_vec_y" | "rayleigh". Required.
        block_rows (int): rows per read of a stored array. Default: 256.

    Returns:
        The alignment (a float; in [−1, 1] for the first three). NaN never: a zero kernel or zero (centered)
        targets raise instead.

    Raises:
        InvalidInput: an unknown variant, a kernel or targets that are zero after centering.
        ShapeMismatch: y's length is not N, tiles outside (N, N), FULL-kernel targets of another width than k.

    Cost: one pass over the kernel, O(N²·k²·c).
    """
    with operation_name(_OPERATION):
        if variant not in VARIANTS:
            raise InvalidInput(detail=f"unknown variant {variant!r}; name one of {', '.join(VARIANTS)}")
        stream = iter_tiles(kernel, name="kernel", block_rows=block_rows)
        raw = np.asarray(y.detach().cpu() if is_torch_tensor(y) else y)
        n = raw.shape[0] if raw.ndim else 0
        if stream.shape is not None and (stream.shape[0] != stream.shape[1] or stream.shape[0] != n):
            raise ShapeMismatch(
                detail=f"the kernel has shape {stream.shape} and y has {n} rows; the kernel must be (N, N, ...) "
                "with N = len(y)"
            )
        sums = _Sums(n)
        targets: np.ndarray | None = None
        centered: np.ndarray | None = None
        for row, col, block in stream:
            if targets is None:
                is_full = block.ndim == 4
                width = block.shape[2] if is_full and variant in ("centered_vec_y", "rayleigh") else None
                targets = as_targets(raw, classes=width)
                if targets.shape[0] != n or (width is not None and targets.shape[1] != width):
                    raise ShapeMismatch(
                        detail=f"y gives targets {targets.shape}; expected ({n}, {width or 'c'}) for this kernel"
                    )
                centered = targets - targets.mean(axis=0)
            assert centered is not None
            r, c = block.shape[0], block.shape[1]
            if row < 0 or col < 0 or row + r > n or col + c > n:
                raise ShapeMismatch(detail=f"a tile at ({row}, {col}) of {r}x{c} lies outside the N = {n} kernel")
            sums.add(block, row, col, variant, targets, centered)
        if targets is None or centered is None:
            raise InvalidInput(detail="the kernel has no tiles")
        return sums.value(variant, targets, centered)


class _Sums:
    """Running sums over tiles; see the module docstring for what each variant needs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inner = 0.0  # ⟨K, T Tᵀ⟩ or vᵀ K v
        self.fro2 = 0.0  # ‖K‖²
        self.row_sums: np.ndarray | None = None  # Σ_m K[n, m, ...]
        self.col_sums: np.ndarray | None = None
        self.full = False
        self.k = 1

    def add(self, block: np.ndarray, row: int, col: int, variant: str, y: np.ndarray, yc: np.ndarray) -> None:
        self.full = block.ndim == 4
        if self.full and variant in ("uncentered", "centered"):
            block = np.einsum("rcaa->rc", block)  # these two read a FULL kernel through its trace
        r, c = block.shape[:2]
        vectors = yc if variant in ("centered", "centered_vec_y") else y
        left, right = vectors[row : row + r], vectors[col : col + c]
        if block.ndim == 4:
            self.k = block.shape[2]
            self.inner += float(np.einsum("ra,rcab,cb->", left, block, right, optimize=True))
        else:
            self.inner += float(np.sum(block * (left @ right.T)))
        self.fro2 += float(np.sum(block * block))
        if variant in ("centered", "centered_vec_y"):
            if self.row_sums is None:
                self.row_sums = np.zeros((self.n, *block.shape[2:]))
                self.col_sums = np.zeros((self.n, *block.shape[2:]))
            assert self.col_sums is not None
            self.row_sums[row : row + r] += block.sum(axis=1)
            self.col_sums[col : col + c] += block.sum(axis=0)

    def _centered_fro(self) -> float:
        """‖(H⊗I) K (H⊗I)‖_F from the sums: ‖K‖² − (‖row sums‖² + ‖col sums‖²)/N + ‖total‖²/N²."""
        assert self.row_sums is not None and self.col_sums is not None
        total = self.row_sums.sum(axis=0)
        value = (
            self.fro2
            - (np.sum(self.row_sums**2) + np.sum(self.col_sums**2)) / self.n
            + float(np.sum(total**2)) / self.n**2
        )
        return float(np.sqrt(max(value, 0.0)))

    def value(self, variant: str, y: np.ndarray, yc: np.ndarray) -> float:
        if variant == "rayleigh":
            norm2 = float(np.sum(y * y))
            if norm2 == 0:
                raise InvalidInput(detail="y is all zeros; the Rayleigh quotient needs nonzero targets")
            # A TRACE kernel stands for (trace / c) ⊗ I_c.
            return self.inner / norm2 / (1 if self.full else y.shape[1])
        if variant == "uncentered":
            kernel_norm, target_norm = np.sqrt(self.fro2), float(np.linalg.norm(y.T @ y))
        elif variant == "centered":
            kernel_norm, target_norm = self._centered_fro(), float(np.linalg.norm(yc.T @ yc))
        else:
            columns = 1 if self.full else y.shape[1]
            kernel_norm, target_norm = self._centered_fro() * np.sqrt(columns), float(np.sum(yc * yc))
        if kernel_norm <= 0 or target_norm <= 0:
            what = "the kernel" if kernel_norm <= 0 else "y"
            raise InvalidInput(
                detail=f"{what} is zero{' after centering' if 'centered' in variant else ''}, so the "
                f"{variant} alignment is undefined (0/0); e.g. labels of a single class"
            )
        return float(self.inner / (kernel_norm * target_norm))
