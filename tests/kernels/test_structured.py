"""Structured derivatives against the independent float64 reference: every rule, both contraction forms (factored
and per-layer Jacobian), all four modes, x2 given and omitted, parameter subsets, and the parameter coverage."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import types
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ntk_service.kernels import KernelMode, NtkImplementation, compute_ntk
from ntk_service.kernels.problem.preparation import prepare_problem
from ntk_service.kernels.problem.private_module import eval_semantics
from ntk_service.kernels.structured import Structured, StructuredOptions, StructuredTerms, structured_terms
from ntk_service.kernels.structured.options import Form
from tests.kernels.conftest import structured_ntk
from tests.reference import assert_matches, reference_ntk

pytestmark = pytest.mark.filterwarnings(
    # torch has no vmap batching rule for CPU flash attention (nn.MultiheadAttention): correct, slower, warned
    "ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning"
)

MODES = list(KernelMode)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny kernels: one intra-op thread avoids thread wake-ups that dominate on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FORMS: list[Form | None] = [None, "factored", "jacobian"]
"""None: compute_ntk (the cost model's choice per weight); the others force every weight with factors into that
form (``StructuredOptions.form``)."""


class TwiceLinear(nn.Module):
    """The same Linear applied twice (weight sharing across calls: cross terms between the uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.shared = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        return self.head(torch.tanh(self.shared(h)))


class BareParameter(nn.Module):
    """Bare parameters in custom math next to rule layers: an elementwise scale and a matrix in ``x @ proj``, both
    read by the op rules."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.randn(5))
        self.proj = nn.Parameter(torch.randn(4, 5))
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)) * self.scale + x @ self.proj)


class RulelessParameter(nn.Module):
    """Parameters in ops no rule covers (an einsum, a division by a parameter, a product of two parameters): they
    take the Jacobian path, the rest the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.mix = nn.Parameter(torch.randn(4, 5))
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.gain, self.gate = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) / self.temperature + torch.einsum("ni,ij->nj", x, self.mix)
        return self.head(h * (self.gain * self.gate))


class ShapeQuery(nn.Module):
    """Reads a rule layer's weight shape outside the layer (metadata only: still covered by the rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 / (self.lin.weight.shape[0] * self.lin.weight.size(1) * self.lin.weight.dim())
        return self.head(torch.tanh(self.lin(x)) * scale)


class SequenceMlp(nn.Module):
    """Linear layers on (T, d) sequences, RMSNorm, per-position outputs flattened to k = T·2."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.norm = nn.RMSNorm(4)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.norm(self.l1(x)))).flatten(1)


class TinyTransformer(nn.Module):
    """Embedding (with padding_idx), MultiheadAttention, LayerNorm, MLP block, mean pooling, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 9, padding_idx=0)
        self.attn = nn.MultiheadAttention(9, 3, batch_first=True)  # odd heads: no fast path
        self.ln1 = nn.LayerNorm(9)
        self.mlp = nn.Sequential(nn.Linear(9, 12), nn.GELU(), nn.Linear(12, 9))
        self.ln2 = nn.LayerNorm(9)
        self.head = nn.Linear(9, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.ln1(h + a)
        h = self.ln2(h + self.mlp(h))
        return self.head(h.mean(1))


class TiedEmbeddingHead(nn.Module):
    """An Embedding whose weight is also the output Linear's (one tensor, two rule kinds)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))).mean(1))


class TiedFunctionalHead(TiedEmbeddingHead):
    """The tied weight used through F.linear in the forward: that use is outside any rule (Jacobian path)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.embed(ids))).mean(1), self.embed.weight)


class TiedLinears(nn.Module):
    """Two Linear layers sharing one weight with separate biases."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


class FoldedBatch(nn.Module):
    """Folds positions into the batch axis around its Linear layers: dim 0 of the layers' input is not the
    examples, so only the per-example (vmap) capture is right for it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        return self.l2(torch.tanh(self.l1(x.reshape(n * t, d)))).reshape(n, t * 2)


class ShuffledBatch(nn.Module):
    """Reverses the examples around a layer and back: dims look batched but rows are other examples."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x.flip(0))).flip(0))


def _cnn2d() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding="same", groups=4, bias=False),
        nn.Flatten(),
        nn.Linear(36, 3),
    )


def _cnn1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1, groups=2),
        nn.ReLU(),
        nn.Conv1d(4, 3, 2, dilation=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(9, 2),
    )


def _batchnorm() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(27, 4),
        nn.BatchNorm1d(4),
        nn.Tanh(),
        nn.Linear(4, 2),
    )
    for bn in (model[1], model[5]):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    return model.eval()


def _floats(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    return lambda g: (torch.randn(3, *shape, generator=g), torch.randn(2, *shape, generator=g))


def _tokens(vocab: int, length: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    # token 0 is the padding index of TinyTransformer; repeats across examples exercise the id matching
    return lambda g: (
        torch.randint(0, vocab, (3, length), generator=g),
        torch.randint(0, vocab, (2, length), generator=g),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple], list[str]]] = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
            _floats(4), ["0.weight", "4.bias"]),
    "cnn2d": (_cnn2d, _floats(2, 6, 6), ["2.weight", "3.bias", "7.*"]),
    "cnn1d": (_cnn1d, _floats(2, 9), ["0.*"]),
    "transformer": (TinyTransformer, _tokens(11, 5), ["embed.weight", "attn.in_proj_weight", "mlp.0.weight"]),
    "twice_linear": (TwiceLinear, _floats(4), ["shared.weight"]),
    "bare_parameter": (BareParameter, _floats(4), ["scale", "lin.weight"]),
    "ruleless_parameter": (RulelessParameter, _floats(4), ["mix", "lin.weight", "gain"]),
    "sequence": (SequenceMlp, _floats(4, 3), ["l1.bias", "norm.weight"]),
    "batchnorm": (_batchnorm, _floats(2, 5, 5), ["1.*", "4.weight"]),
    "tied_embedding_head": (TiedEmbeddingHead, _tokens(7, 4), ["embed.weight"]),
    "tied_functional_head": (TiedFunctionalHead, _tokens(7, 4), ["embed.weight", "mix.bias"]),
    "tied_linears": (TiedLinears, _floats(4), ["enc.weight", "dec.bias"]),
    "folded_batch": (FoldedBatch, _floats(4, 3), ["l2.*"]),
    "shape_query": (ShapeQuery, _floats(4), ["lin.bias"]),
    "shuffled_batch": (ShuffledBatch, _floats(3), ["l1.weight"]),
}  # fmt: skip
"""name -> (build, inputs (x1 (3, ...), x2 (2, ...)), a parameter subset)."""


@functools.cache
def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    build, inputs, _ = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
    x1, x2 = inputs(torch.Generator().manual_seed(1))
    return model, x1, x2


@functools.cache
def _reference(name: str, mode: KernelMode, with_x2: bool, subset: bool) -> torch.Tensor:
    model, x1, x2 = _case(name)
    return reference_ntk(model, x1, x2 if with_x2 else None, mode.value, MODELS[name][2] if subset else None)


def _structured(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    mode: KernelMode,
    *,
    form: Form | None,
    params: list[str] | None = None,
    dtype: torch.dtype = torch.float64,
    options: StructuredOptions | None = None,
) -> torch.Tensor:
    """compute_ntk(implementation="structured") for form None; the same pipeline with a forced form otherwise."""
    if form is None and options is None:
        result = compute_ntk(model, x1, x2, mode=mode, implementation="structured", params=params, dtype=dtype)
        assert result.implementation is NtkImplementation.STRUCTURED
        return result.theta
    options = StructuredOptions() if options is None else options
    if form is not None:
        options = dataclasses.replace(options, form=form)
    return structured_ntk(model, x1, x2, mode, options=options, params=params, dtype=dtype)


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_float64_matches_reference(name: str, form: str | None) -> None:
    model, x1, x2 = _case(name)
    for mode in MODES:
        for with_x2 in (True, False) if form is None else (True,):  # the forms share the x2-omitted path
            theta = _structured(model, x1, x2 if with_x2 else None, mode, form=form)
            assert theta.dtype == torch.float64
            assert_matches(theta, _reference(name, mode, with_x2, False), 1e-10)


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_subset_matches_reference(name: str) -> None:
    model, x1, x2 = _case(name)
    for mode in (KernelMode.FULL, KernelMode.EXAMPLE_DIAGONAL):
        for form in ("factored", "jacobian"):
            theta = _structured(model, x1, x2, mode, form=form, params=MODELS[name][2])
            assert_matches(theta, _reference(name, mode, True, True), 1e-10)


def _coverage(name: str, params: list[str] | None = None) -> dict[str, str]:
    model, x1, x2 = _case(name)
    with eval_semantics(model) as module:
        problem, x1t, _ = prepare_problem(module, x1, x2, params=params, dtype=torch.float64)
        covered = structured_terms(problem, x1t[:1]).covered()
    names = [n for n, _ in covered]
    assert len(names) == len(set(names)), f"a parameter is contracted twice: {sorted(names)}"
    return dict(covered)


@pytest.mark.parametrize("subset", [False, True], ids=["all", "subset"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_selected_parameter_is_covered_once(name: str, subset: bool) -> None:
    model, _, _ = _case(name)
    params = MODELS[name][2] if subset else None
    with eval_semantics(model) as module:
        problem, _, _ = prepare_problem(module, _case(name)[1], None, params=params, dtype=torch.float64)
        selected = set(problem.params)
    names = {n for n, _ in model.named_parameters()}
    expected = {n for n in names if any(fnmatch.fnmatchcase(n, g) for g in params)} if params else names
    assert selected == expected
    assert set(_coverage(name, params)) == expected


def test_coverage_sends_only_unruled_uses_to_the_jacobian_path() -> None:
    transformer = _coverage("transformer")
    assert "fallback" not in transformer.values()  # MultiheadAttention's projections are linear ops too
    assert transformer["attn.in_proj_weight"] in ("factored", "rule")
    assert transformer["head.weight"] == "factored"
    assert transformer["mlp.0.weight"] in ("factored", "rule")  # over 5 positions, J of a 9x12 weight is cheaper
    assert transformer["ln1.weight"] == transformer["ln2.bias"] == "rule"
    assert _coverage("bare_parameter") == {
        "lin.weight": "factored",
        "lin.bias": "factored",
        "scale": "rule",  # an elementwise scale of an activation
        "proj": "factored",  # x @ proj: a linear op with the weight stored (in, out)
        "head.weight": "factored",
        "head.bias": "factored",
    }
    ruleless = _coverage("ruleless_parameter")
    assert {n for n, kind in ruleless.items() if kind == "fallback"} == {"temperature", "mix", "gain", "gate"}
    assert ruleless["lin.weight"] == ruleless["head.weight"] == "factored"
    assert _coverage("tied_embedding_head")["embed.weight"] == "rule"  # Embedding + Linear uses: J summed
    assert _coverage("tied_functional_head")["embed.weight"] == "rule"  # the F.linear use is a linear op too
    assert _coverage("twice_linear")["shared.weight"] in ("factored", "rule")
    assert "fallback" not in _coverage("shape_query").values()  # reading w.shape is not a use of w
    cnn = _coverage("cnn2d")
    assert cnn["3.weight"] == "rule" and "fallback" not in cnn.values()


def test_the_plan_names_the_ops_without_a_rule() -> None:
    model, x1, _ = _case("ruleless_parameter")
    with eval_semantics(model) as module:
        problem, x1t, _ = prepare_problem(module, x1, None, params=None, dtype=torch.float64)
        outside = structured_terms(problem, x1t[:1]).plan.outside
    assert outside == {
        "temperature": ("Tensor.div",),
        "mix": ("einsum",),
        "gain": ("Tensor.mul",),
        "gate": ("Tensor.mul",),
    }


def test_a_forward_set_on_the_instance_is_read_by_its_ops() -> None:
    """A Linear whose forward was replaced on the instance (accelerate's hooks do that) computes other math, which
    the engine reads by its ops: here a linear op of twice the weight (a scaled use of the parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    first = model[0]
    doubled = types.MethodType(lambda self, x: F.linear(x, 2.0 * self.weight, self.bias), first)
    first.forward = doubled  # type: ignore[method-assign]
    x1, x2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with eval_semantics(model) as module:
        problem, x1t, _ = prepare_problem(module, x1, x2, params=None, dtype=torch.float64)
        terms = structured_terms(problem, x1t[:1])
    assert terms.coverage()["0.weight"] != "fallback" and terms.plan.sites[0].param("weight").scale == 2.0
    for mode in MODES:
        for form in FORMS:
            theta = _structured(model, x1, x2, mode, form=form)
            assert_matches(theta, reference_ntk(model, x1, x2, mode.value), 1e-10)


def test_float32_matches_reference() -> None:
    model, x1, x2 = _case("transformer")
    for mode in MODES:
        theta = _structured(model, x1, x2, mode, form=None, dtype=torch.float32)
        assert theta.dtype == torch.float32
        assert_matches(theta, _reference("transformer", mode, True, False), 1e-4)


def test_hooks_are_removed_after_a_call() -> None:
    model, x1, _ = _case("twice_linear")
    compute_ntk(model, x1, implementation="structured")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_auto_picks_structured_for_a_wide_mlp() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    result = compute_ntk(model, torch.randn(8, 64), mode="trace")
    assert result.implementation is NtkImplementation.STRUCTURED


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mlp", True),
        ("cnn2d", True),
        ("transformer", True),  # MultiheadAttention's (T, n, d) and (T·n, d) layouts: the examples stay apart
        ("folded_batch", True),  # positions folded into the batch as (n·T, d): example-major rows
        ("shuffled_batch", False),
        ("ruleless_parameter", False),  # fallback parameters: per example
    ],
)
def test_batched_capture_only_where_the_examples_stay_apart(name: str, expected: bool) -> None:
    """The batched capture is used only when it is exact (every site keeps the examples apart, at a place found on
    two examples); the others take the per-example (vmap) capture."""
    model, x1, _ = _case(name)
    with eval_semantics(model) as module:
        problem, x1t, _ = prepare_problem(module, x1, None, params=None, dtype=torch.float64)
        before = structured_terms(problem, x1t[:1])
        Structured().left(problem, x1t)
        assert before.batch_safe is None  # plans are frozen: what a block shows makes a new one
        assert structured_terms(problem).batch_safe is expected


@pytest.mark.parametrize("name", ["mlp", "cnn1d", "transformer"])
def test_side_with_itself_matches_reference(name: str) -> None:
    """x2 omitted, one block of an odd number of examples paired with itself, both forms."""
    options = StructuredOptions()
    model, _, _ = _case(name)
    x = torch.cat([MODELS[name][1](torch.Generator().manual_seed(s))[0] for s in range(4)])[:9]
    assert x.shape[0] == 9
    forms: tuple[Form, ...] = ("factored", "jacobian")
    for form in forms:
        theta = _structured(model, x, None, KernelMode.FULL, form=form, options=options)
        assert_matches(theta, reference_ntk(model, x, None, "full"), 1e-10)


class ViewedConv(nn.Module):
    """A CNN that ``.view``s an inner convolution's output (needs NCHW strides) for a skip head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 2)
        self.skip = nn.Linear(27, 3)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        skip = self.skip(h.view(h.shape[0], -1))
        return self.head(torch.tanh(self.conv2(h)).flatten(1)) + skip


@pytest.mark.parametrize(("build", "channels_last"), [(_cnn2d, True), (ViewedConv, False)])
def test_convolutional_capture_in_channels_last_or_nchw(build: Callable[[], nn.Module], channels_last: bool) -> None:
    """The batched capture of a CNN runs its convolutions in channels-last memory where the model allows it,
    and in NCHW where it views a convolution's output; both give the reference kernel."""
    terms = _conv_capture_matches_reference(build, seed=2, form="cheaper")
    assert terms.batch_safe and terms.channels_last is channels_last


def _conv_capture_matches_reference(build: Callable[[], nn.Module], seed: int, form: Form) -> StructuredTerms:
    """The FULL structured kernel of a small CNN on (3, 2, 6, 6) and (2, 2, 6, 6) inputs, checked against the
    float64 reference; returns the terms (plan) it used."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
    g = torch.Generator().manual_seed(seed)
    x1, x2 = torch.randn(3, 2, 6, 6, generator=g), torch.randn(2, 2, 6, 6, generator=g)
    with eval_semantics(model) as module:
        problem, x1t, x2t = prepare_problem(module, x1, x2, params=None, dtype=torch.float64)
        alg = Structured(StructuredOptions(form=form))
        theta = alg.pair(problem, alg.left(problem, x1t), alg.left(problem, x2t), KernelMode.FULL)
        terms = alg.terms(problem)  # the plan after the blocks: what they showed is in it
    assert_matches(theta, reference_ntk(model, x1, x2, "full"), 1e-10)
    return terms


class ReversedBatchConv(nn.Module):
    """Convolutions on the batch in reverse order: not batch safe, so the per-example (vmapped) capture."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 2, dilation=2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x.flip(0)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1).flip(0))


def test_convolutional_capture_per_example_matches_reference() -> None:
    terms = _conv_capture_matches_reference(ReversedBatchConv, seed=3, form="jacobian")
    assert terms.batch_safe is False


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_convolutional_capture_leaves_the_output_layer_delta_shared(
    mode: KernelMode, shared_deltas: list[torch.Tensor]
) -> None:
    """The k-pass capture of a CNN gives its output Linear δ_c = e_c for every example (stride 0), so the
    contraction takes the Δ ⊗ G^A shortcut (NOTE [example-independent δ]); the kernel matches the reference."""
    model, x1, x2 = _case("cnn2d")
    theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured", dtype=torch.float64).theta
    assert_matches(theta, _reference("cnn2d", mode, True, False), 1e-10)
    if mode.spec.pairs:  # the per-example blocks have their own contraction
        assert shared_deltas and torch.equal(shared_deltas[0], torch.eye(3, dtype=torch.float64))
