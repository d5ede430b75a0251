"""The words every layer shares, without torch: kernel modes, implementations and the table of modes.

The engine (``ntk_service.kernels``), the server's schemas, the client, the CLI, the lab console and the docs all
read the modes from ``MODES``, one row per mode, so a mode is added in one place. Importing this module loads
neither torch nor numpy (the client and the CLI's ``--help`` import it).

A mode says which part of Θ(x1, x2) = J(x1) J(x2)ᵀ a call returns. Its row declares the axes of the result (an
entry per example pair or per example, and all k × k outputs, their diagonal, or its sum), from which its shape,
how the engine contracts it, how a result is mirrored and how its dimensions are named all follow:

    >>> MODES["trace"].shape
    ('N', 'M')
    >>> MODES["example_diagonal"].result_shape(5, 4, 3)          # x2 is not used
    (5, 3, 3)
    >>> KernelMode.OUTPUT_DIAGONAL.spec.dimension_names
    ('x1', 'x2', 'out')
    >>> DerivedMode.PSEUDO.spec.base                             # the TRACE kernel of a derived model
    <KernelMode.TRACE: 'trace'>

A *contracted* mode is contracted by the implementations themselves, never reduced from a FULL block. A *derived*
mode is the kernel, in a contracted mode (``base``), of a model whose outputs are a linear map of the model's
(``kernels/derived.py`` holds the maps): the pseudo-NTK is the TRACE kernel of Σ_a f_a / √k.

Adding a mode: a member of ``KernelMode`` (contracted) or ``DerivedMode`` (derived), its row in ``MODES``, its name
in the ``Literal`` types below (``tests/test_vocabulary.py`` checks they agree), and for a derived mode its output
map in ``kernels/derived.py``. A contracted mode's axes are any of ``Examples`` × ``Outputs``: the implementations
key their contractions to the axes (NOTE [mode contractions] in ``kernels/modes.py``), so this file is the only one
(docs/development.md, "Adding a mode"; its float64 reference goes into ``tests/reference.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from ntk_service.errors import UnknownImplementation, UnknownMode

__all__ = [
    "CONTRACTED_MODES",
    "DERIVED_MODES",
    "MODES",
    "MODE_NAMES",
    "OPERATOR_MODES",
    "ContractedModeName",
    "DerivedMode",
    "Examples",
    "ImplementationName",
    "KernelMode",
    "ModeName",
    "ModeSpec",
    "NtkImplementation",
    "OperatorModeName",
    "Outputs",
    "SolverName",
    "mode_help",
    "mode_table",
    "parse_any_mode",
    "parse_implementation",
    "parse_mode",
    "result_shape",
]


class KernelMode(StrEnum):
    """The contracted modes: each is contracted directly by the implementations, never reduced from a FULL block.

    Names are chosen so no one can confuse the two diagonals: EXAMPLE_DIAGONAL is Θ(x1_n, x1_n) (N, k, k),
    OUTPUT_DIAGONAL the torch.func tutorial's ``compute='diagonal'`` (N, M, k).
    """

    FULL = "full"
    """(N, M, k, k): every output pair of every example pair."""
    TRACE = "trace"
    """(N, M): Σ_a Θ_aa, the plain sum over the k outputs (neural-tangents' ``trace_axes`` divides by k)."""
    EXAMPLE_DIAGONAL = "example_diagonal"
    """(N, k, k): Θ(x1_n, x1_n) for each example of x1 alone; needs only N per-example terms."""
    OUTPUT_DIAGONAL = "output_diagonal"
    """(N, M, k): Θ_aa for every example pair; the torch.func tutorial's ``compute='diagonal'``."""
    EXAMPLE_OUTPUT_DIAGONAL = "example_output_diagonal"
    """(N, k): Θ(x1_n, x1_n)_aa for each example of x1 alone: the prior variance of each output."""
    EXAMPLE_TRACE = "example_trace"
    """(N,): Σ_a Θ(x1_n, x1_n)_aa = ‖J(x1_n)‖²_F for each example of x1 alone: the GP prior variance of the
    summed outputs, the denominator of a leverage score."""

    @property
    def spec(self) -> ModeSpec:
        """This mode's row of ``MODES``."""
        return MODES[self.value]


class DerivedMode(StrEnum):
    """Modes computed as an engine kernel of a derived model, never by the implementations themselves."""

    PSEUDO = "pseudo"
    """(N, M): (1/k) Σ_ab Θ_ab, the pseudo-NTK (Mohamadi, Bae & Sutherland 2023): the NTK of Σ_a f_a / √k, one
    gradient per example instead of k (``kernels/derived.py``)."""

    @property
    def spec(self) -> ModeSpec:
        """This mode's row of ``MODES``."""
        return MODES[self.value]


class NtkImplementation(StrEnum):
    """How the kernel is computed. All give the same numbers; they differ in time and memory.

    Attributes:
        AUTO: pick from the cost model (P, k, N, M, per-layer shapes, the counted forward cost).
        JACOBIAN_CONTRACTION: build J per block with ``vmap(jacrev)``, one einsum per parameter tensor. Best for
            small k and an expensive forward pass. Time (N+M)·k·[FP] + N·M·k²·P; memory (n+m)·k·P per block.
        NTK_VECTOR_PRODUCTS: J(x2) is never built: ``jvp`` on x2 of the ``vjp`` rows of x1. Best for a cheap
            forward pass and huge P. Time N·M·k·[FP]; memory of one block of VJPs.
        STRUCTURED: per-layer structure rules (a Linear layer's Jacobian is δ aᵀ, so its term is (δ1·δ2)(a1·a2)).
            Fastest where rules cover the parameters; the rest falls back to the Jacobian path.
    """

    AUTO = "auto"
    JACOBIAN_CONTRACTION = "jacobian_contraction"
    NTK_VECTOR_PRODUCTS = "ntk_vector_products"
    STRUCTURED = "structured"


class Examples(StrEnum):
    """The example axes of a mode's result."""

    PAIRS = "pairs"
    """(N, M): an entry for every pair of an example of x1 and an example of x2."""
    SAME = "same"
    """(N,): an entry for each example of x1 with itself; x2 is not used."""


class Outputs(StrEnum):
    """The output axes of a mode's result, per entry."""

    ALL = "all"
    """(k, k): every pair of outputs a, b."""
    DIAGONAL = "diagonal"
    """(k,): the same output on both sides, Θ_aa."""
    SUM = "sum"
    """(): Σ_a Θ_aa, the plain sum of the diagonal."""

    def entries(self, k: int) -> int:
        """Numbers per entry of the result for k outputs: k² all, k the diagonal, 1 its sum."""
        return {Outputs.ALL: k * k, Outputs.DIAGONAL: k, Outputs.SUM: 1}[self]

    def products(self, k: int) -> int:
        """Output pairs (a, b) whose products J_a · J_b an entry's contraction takes: k² for all of them, k for the
        diagonal and for its sum (the cost models' count)."""
        return k * k if self is Outputs.ALL else k


_OUTPUT_AXES = {Outputs.ALL: ("k", "k"), Outputs.DIAGONAL: ("k",), Outputs.SUM: ()}
_OUTPUT_NAMES = {Outputs.ALL: ("out1", "out2"), Outputs.DIAGONAL: ("out",), Outputs.SUM: ()}


@dataclass(frozen=True)
class ModeSpec:
    """One mode: its wire name, its axes and what follows from them.

    Attributes:
        name: the wire value ("full", "trace", ...), the ``KernelMode`` / ``DerivedMode`` value.
        examples: an entry per example pair (N, M) or per example of x1 (N,).
        outputs: per entry all k × k outputs, their diagonal (k,) or its sum ().
        entry: the formula of one entry, for docs and help texts.
        base: for a derived mode, the contracted mode its kernel of the derived model is taken in (its axes are
            that mode's); None for a contracted mode.
    """

    name: str
    examples: Examples
    outputs: Outputs
    entry: str
    base: KernelMode | None = None

    @property
    def mode(self) -> KernelMode | DerivedMode:
        """The enum member of this row."""
        return DerivedMode(self.name) if self.derived else KernelMode(self.name)

    @property
    def derived(self) -> bool:
        """A kernel of a derived model (``base``), not a contraction of the implementations."""
        return self.base is not None

    @property
    def axes(self) -> tuple[Examples, Outputs]:
        """(examples, outputs): what the implementations key their contractions to (NOTE [mode contractions])."""
        return self.examples, self.outputs

    @property
    def pairs(self) -> bool:
        """Entries for example pairs (N, M): x2 is used, and a result has a column axis."""
        return self.examples is Examples.PAIRS

    @property
    def shape(self) -> tuple[str, ...]:
        """The result's axes: ("N", "M", "k", "k") for "full"; a derived mode's k is its derived model's."""
        return ("N", "M")[: 2 if self.pairs else 1] + _OUTPUT_AXES[self.outputs]

    @property
    def shape_text(self) -> str:
        """The shape as docs write it, e.g. "(N, M, k, k)", "(N,)"."""
        return "(" + ", ".join(self.shape) + ("," if len(self.shape) == 1 else "") + ")"

    @property
    def dimension_names(self) -> tuple[str, ...]:
        """The result's dimension names in a stored result (docs/results.md): x1, x2, out1, out2, out."""
        return ("x1", "x2")[: 2 if self.pairs else 1] + _OUTPUT_NAMES[self.outputs]

    @property
    def example_swap(self) -> tuple[int, ...]:
        """The axis permutation taking the kernel to its transpose as a matrix: Θ(x1, x2) to Θ(x2, x1) for example
        pairs (the example axes swapped, and for all outputs the output axes too: Θ[n, m, a, b] = Θ[m, n, b, a]);
        for a per-example mode each example's block transposed (its output axes swapped, if it has two)."""
        if self.pairs:
            return {Outputs.ALL: (1, 0, 3, 2), Outputs.DIAGONAL: (1, 0, 2), Outputs.SUM: (1, 0)}[self.outputs]
        return {Outputs.ALL: (0, 2, 1), Outputs.DIAGONAL: (0, 1), Outputs.SUM: (0,)}[self.outputs]

    @property
    def is_matrix(self) -> bool:
        """Θ is a matrix, (N·k, M·k) or (N, M): a linear operator between the sides (the diagonals are not)."""
        return self.pairs and self.outputs is not Outputs.DIAGONAL

    @property
    def contraction(self) -> KernelMode:
        """What the implementations contract for it (NOTE [mode contractions]): a mode of example pairs itself (they
        read its axes), a per-example mode the contracted mode of the per-example blocks of all outputs (its own
        outputs then reduced per example); a derived mode its base."""
        if self.base is not None:
            return self.base
        if not self.pairs:
            return KernelMode(_PER_EXAMPLE_BLOCKS)
        return KernelMode(self.name)

    def result_shape(self, n: int, m: int, k: int) -> tuple[int, ...]:
        """The shape of theta for N = n, M = m and k outputs (per example of the model the kernel is taken of)."""
        sizes = {"N": n, "M": m, "k": k}
        return tuple(sizes[axis] for axis in self.shape)


_CONTRACTED_ROWS = (
    ModeSpec("full", Examples.PAIRS, Outputs.ALL, "Θ[n, m, a, b] = J_a(x1[n]) · J_b(x2[m])"),
    ModeSpec("trace", Examples.PAIRS, Outputs.SUM, "Σ_a Θ[n, m, a, a], the plain **sum** over outputs"),
    ModeSpec("example_diagonal", Examples.SAME, Outputs.ALL, "Θ(x1[n], x1[n]): the N same-example blocks (x2 unused)"),
    ModeSpec(
        "output_diagonal", Examples.PAIRS, Outputs.DIAGONAL, 'Θ[n, m, a, a] (the torch.func tutorial\'s "diagonal")'
    ),
    ModeSpec(
        "example_output_diagonal",
        Examples.SAME,
        Outputs.DIAGONAL,
        "Θ(x1[n], x1[n])[a, a]: the diagonal of each `example_diagonal` block (x2 unused)",
    ),
    ModeSpec(
        "example_trace",
        Examples.SAME,
        Outputs.SUM,
        "Σ_a Θ(x1[n], x1[n])[a, a] = ‖J(x1[n])‖²: the trace of each `example_diagonal` block (x2 unused)",
    ),
)
"""The contracted modes: (wire name, example axes, output axes, entry)."""

_PER_EXAMPLE_BLOCKS = next(row.name for row in _CONTRACTED_ROWS if row.axes == (Examples.SAME, Outputs.ALL))
"""The contracted mode of the per-example blocks of all outputs (``NtkAlgorithm.diagonal``)."""

_DERIVED_ROWS = ((DerivedMode.PSEUDO, KernelMode.TRACE, "(1/k) Σ_ab Θ[n, m, a, b], the pseudo-NTK"),)
"""The derived modes: (mode, base mode, entry); the axes are the base mode's."""


def _derived(mode: DerivedMode, base: KernelMode, entry: str) -> ModeSpec:
    axes = next(row for row in _CONTRACTED_ROWS if row.name == base.value)
    return ModeSpec(mode.value, axes.examples, axes.outputs, entry, base=base)


MODES: dict[str, ModeSpec] = {row.name: row for row in _CONTRACTED_ROWS} | {
    mode.value: _derived(mode, base, entry) for mode, base, entry in _DERIVED_ROWS
}
"""Every mode by wire name, contracted modes first (the order of the docs' tables and of help texts)."""

MODE_NAMES: tuple[str, ...] = tuple(MODES)
"""Every mode's wire name."""

CONTRACTED_MODES: tuple[KernelMode, ...] = tuple(KernelMode(s.name) for s in MODES.values() if not s.derived)
"""The modes the implementations contract: what a batch job stores."""

DERIVED_MODES: tuple[DerivedMode, ...] = tuple(DerivedMode(s.name) for s in MODES.values() if s.derived)
"""The modes computed as a kernel of a derived model."""

OPERATOR_MODES: tuple[KernelMode | DerivedMode, ...] = tuple(s.mode for s in MODES.values() if s.is_matrix)
"""The modes whose kernel is a matrix, so a linear operator between the sides (Θ·v): not the diagonals."""

ModeName = Literal[
    "full", "trace", "example_diagonal", "output_diagonal", "example_output_diagonal", "example_trace", "pseudo"
]
"""A mode's wire value (``MODE_NAMES``): "full" (N, M, k, k), "trace" (N, M), "example_diagonal" (N, k, k),
"output_diagonal" (N, M, k), "example_output_diagonal" (N, k), "example_trace" (N,), "pseudo" (N, M) =
(1/k) Σ_ab Θ_ab."""

ContractedModeName = Literal[
    "full", "trace", "example_diagonal", "output_diagonal", "example_output_diagonal", "example_trace"
]
"""A contracted mode's wire value (``CONTRACTED_MODES``): the modes a batch job stores."""

OperatorModeName = Literal["full", "trace", "pseudo"]
"""A mode whose kernel is a linear operator (``OPERATOR_MODES``): the modes of one product Θ v."""

ImplementationName = Literal["auto", "jacobian_contraction", "ntk_vector_products", "structured"]
"""An implementation's wire value (``NtkImplementation``); "auto" picks by cost (a result names the one that ran)."""

SolverName = Literal["auto", "dense", "pcg", "block", "cg", "direct"]
"""A solver's wire value: a name of the solver table (``SOLVERS`` in ``analysis/solve/table.py``) or an older
spelling it still reads ("cg": "pcg", "direct": "dense"). Here so the client and the CLI name them without numpy."""


def parse_any_mode(mode: KernelMode | DerivedMode | str, *, operation: str = "compute_ntk") -> KernelMode | DerivedMode:
    """The KernelMode or DerivedMode for ``mode`` or its wire value.

    Raises:
        UnknownMode: not a mode; the message names the valid ones.
    """
    spec = MODES.get(mode) if isinstance(mode, str) else None
    if spec is None:
        valid = ", ".join(repr(name) for name in MODES)
        raise UnknownMode(f"{operation}: unknown mode {mode!r}; expected one of {valid}")
    return spec.mode


def parse_mode(mode: KernelMode | str, *, operation: str = "compute_ntk") -> KernelMode:
    """The KernelMode (a contracted mode) for ``mode`` or its wire value.

    Raises:
        UnknownMode: not a contracted mode; the message names the valid ones.
    """
    spec = MODES.get(mode) if isinstance(mode, str) else None
    if spec is None or spec.derived:
        valid = ", ".join(repr(m.value) for m in CONTRACTED_MODES)
        raise UnknownMode(f"{operation}: unknown mode {mode!r}; expected one of {valid}")
    return KernelMode(spec.name)


def parse_implementation(
    implementation: NtkImplementation | str, *, operation: str = "compute_ntk"
) -> NtkImplementation:
    """The NtkImplementation for ``implementation`` or its wire value.

    Raises:
        UnknownImplementation: not an implementation; the message names the valid ones.
    """
    try:
        return NtkImplementation(implementation)
    except ValueError:
        valid = ", ".join(repr(i.value) for i in NtkImplementation)
        raise UnknownImplementation(
            f"{operation}: unknown implementation {implementation!r}; expected one of {valid}"
        ) from None


def result_shape(mode: KernelMode | DerivedMode | str, n: int, m: int, k: int) -> tuple[int, ...]:
    """Shape of theta for ``mode`` with N = n, M = m examples and k outputs (``ModeSpec.result_shape``)."""
    return MODES[mode].result_shape(n, m, k)


def mode_help(names: tuple[str, ...] | None = None) -> str:
    """One line naming the modes with their shapes, for help texts and schema descriptions, e.g.
    "full (N, M, k, k) | trace (N, M)". Default: every mode."""
    return " | ".join(f"{name} {MODES[name].shape_text}" for name in (MODE_NAMES if names is None else names))


_COLUMNS: dict[str, Callable[[ModeSpec], str]] = {
    "mode": lambda s: f"`{s.name}`",
    "shape": lambda s: s.shape_text,
    "entry": lambda s: s.entry,
    "dimensions": lambda s: "`" + ", ".join(s.dimension_names) + "`",
    "kind": lambda s: f"derived: the `{s.base}` kernel of a derived model" if s.base is not None else "contracted",
}


def mode_table(columns: tuple[str, ...] = ("mode", "shape", "entry"), *, derived: bool = True) -> str:
    """The modes as a Markdown table (the docs' tables are made from it: docs/_hooks/mode_tables.py).

    Args:
        columns: any of "mode", "shape", "entry", "dimensions", "kind". Default: mode, shape, entry.
        derived: include the derived modes. Default: True.
    """
    rows = [s for s in MODES.values() if derived or not s.derived]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_COLUMNS[c](s) for c in columns) + " |" for s in rows]
    return "\n".join(lines)
