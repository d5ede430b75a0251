"""The engine on exported programs (issue 37): every test model, exported with ``torch.export`` the way
``Client.register_module`` does and loaded by the service's checked loader, agrees with the float64 reference of the
same ``nn.Module`` in every implementation and mode, with parameter subsets and groups; and the structured engine
reads the program's graph as it reads the module's forward: the same parameters take the same paths (the path
report), none of these models leaves a parameter to per-example autograd, and a transformer's attention projections
and MLP are structured on both (only attention's own product is differentiated through)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks._models import ResNet, TransformerClassifier, randomize_batchnorm
from ntk_service.client._export import export_module
from ntk_service.kernels import KernelMode, NtkImplementation, compute_ntk, compute_ntk_groups
from ntk_service.kernels.paths import PathReport, describe_paths
from ntk_service.kernels.structured import capture as structured_capture
from ntk_service.layers import MeanPool, NtkConv1d, NtkConv2d, NtkLinear, PositionEmbedding, Residual
from ntk_service.registry.exported import load_exported
from tests.reference import assert_matches, reference_columns, reference_jacobian, reference_kernel
from tests.registry.exported_models import GatedLoop, TinyAttention, TwoBranch

pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning"
)

IMPLEMENTATIONS = [
    NtkImplementation.STRUCTURED,
    NtkImplementation.JACOBIAN_CONTRACTION,
    NtkImplementation.NTK_VECTOR_PRODUCTS,
    NtkImplementation.AUTO,
]
VOCAB = 11


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny kernels: one intra-op thread avoids thread wake-ups that dominate on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Case:
    """A test model: how to build it, its inputs, how it is exported and what kernel a request asks of it."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], Any]  # (n, generator) -> x (n, ...), or a dict of such
    shape: Any  # export_module's input_shape
    dtype: Any  # export_module's input_dtype
    subset: tuple[str, ...]  # a parameter subset (globs)
    output: str | None = None  # compute_ntk's output= on the program (and the module)
    select: Callable[[Any], torch.Tensor] | None = None  # the same selection written by hand, for the reference


class Transpose(nn.Module):
    """(B, T, C) <-> (B, C, T): a sequence into a Conv1d and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def _floats(*shape: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, g: torch.randn(n, *shape, generator=g)


def _ids(length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, g: torch.randint(0, VOCAB, (n, length), generator=g)


def _resnet() -> nn.Module:
    model = ResNet(widths=(2, 3), in_channels=2, k=3)
    return randomize_batchnorm(model, torch.Generator().manual_seed(4)).eval()


def _quiet(build: Callable[[], nn.Module]) -> nn.Module:
    with warnings.catch_warnings():  # transformers warns about config ids outside a tiny vocabulary
        warnings.simplefilter("ignore")
        return build().eval()


def _bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        max_position_embeddings=8,
    )  # fmt: skip
    return _quiet(lambda: transformers.BertForMaskedLM(config))


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    return _quiet(lambda: transformers.GPT2LMHeadModel(config))


def _vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=2, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=12, num_labels=3,
    )  # fmt: skip
    return _quiet(lambda: transformers.ViTForImageClassification(config))


def _logits(index: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    return lambda out: index(out["logits"] if isinstance(out, dict) else out.logits)


CASES: dict[str, Case] = {
    "mlp": Case(
        lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)),
        _floats(4), (4,), "float32", ("0.*", "4.weight"),
    ),
    "ntk_mlp": Case(
        lambda: nn.Sequential(NtkLinear(4, 6, w_std=1.5, b_std=0.3), nn.ReLU(), NtkLinear(6, 3)),
        _floats(4), (4,), "float32", ("0.weight", "2.bias"),
    ),
    "ntk_conv2d": Case(  # every layer the project ships takes the structured path: NTK convolutions, Residual
        lambda: nn.Sequential(
            NtkConv2d(2, 3, 3, padding=1, w_std=1.3), nn.ReLU(),
            Residual(nn.Sequential(NtkConv2d(3, 3, 3, padding=1, b_std=0.5), nn.Tanh())), nn.Flatten(),
            NtkLinear(3 * 4 * 4, 3),
        ),
        _floats(2, 4, 4), (2, 4, 4), "float32", ("0.weight", "2.body.0.bias"),
    ),
    "ntk_sequence": Case(  # NtkConv1d, PositionEmbedding, MeanPool
        lambda: nn.Sequential(
            PositionEmbedding(6, 2), Transpose(), NtkConv1d(2, 4, 3, padding=1), nn.GELU(), Transpose(),
            MeanPool(1), NtkLinear(4, 3),
        ),
        _floats(6, 2), (6, 2), "float32", ("0.embedding.weight", "2.weight"),
    ),
    "cnn": Case(
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3, stride=2), nn.Tanh(), nn.Flatten(),
            nn.Linear(4 * 2 * 2, 3),
        ),
        _floats(2, 6, 6), (2, 6, 6), "float32", ("0.*", "5.bias"),
    ),
    "resnet": Case(_resnet, _floats(2, 6, 6), (2, 6, 6), "float32", ("stem.*", "blocks.1.bn2.*", "head.weight")),
    "transformer": Case(
        lambda: TransformerClassifier(vocab=VOCAB, max_len=5, d=8, heads=2, d_ff=12, layers=1, k=3),
        _ids(5), (5,), "int64", ("position", "encoder.0.self_attn.*", "encoder.0.linear1.weight"),
    ),
    "attention": Case(lambda: TinyAttention(d=4, classes=3), _floats(3, 4), (3, 4), "float32", ("qkv.*",)),
    "gated_loop": Case(lambda: GatedLoop(width=5, depth=3, classes=3), _floats(5), (5,), "float32", ("gate",)),
    "two_branch": Case(lambda: TwoBranch(), _floats(5), (5,), "float32", ("norm.*", "gate.weight")),
    "bert": Case(
        _bert, lambda n, g: {"input_ids": _ids(5)(n, g)}, {"input_ids": (5,)}, {"input_ids": "int64"},
        ("*attention*", "bert.embeddings.word_embeddings.weight"),
        "logits[:, 2, :4]", _logits(lambda t: t[:, 2, :4]),
    ),
    "gpt2": Case(
        _gpt2, lambda n, g: {"input_ids": _ids(5)(n, g)}, {"input_ids": (5,)}, {"input_ids": "int64"},
        ("transformer.h.0.attn.*", "transformer.wpe.weight"),
        "logits[:, -1, :4]", _logits(lambda t: t[:, -1, :4]),
    ),
    "vit": Case(
        _vit, lambda n, g: {"pixel_values": _floats(2, 8, 8)(n, g)}, {"pixel_values": (2, 8, 8)}, {},
        ("vit.embeddings.*", "classifier.*"), "logits", _logits(lambda t: t),
    ),
}  # fmt: skip
_SLOW = {"bert", "gpt2", "vit", "resnet", "transformer"}
_CASES = [pytest.param(name, marks=[pytest.mark.slow] if name in _SLOW else []) for name in CASES]


@functools.cache
def _model(name: str) -> tuple[nn.Module, nn.Module, Any, Any]:
    """The module, its exported program (loaded as the service loads it), x1 (3 examples) and x2 (2): made once."""
    case = CASES[name]
    torch.manual_seed(0)
    module = case.build().eval()
    with torch.no_grad():  # weights away from their initial values (zero biases would hide bias terms)
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    archive = export_module(module, input_shape=case.shape, input_dtype=case.dtype)
    program = load_exported(archive, operation="test").module
    g = torch.Generator().manual_seed(1)
    return module, program, case.inputs(3, g), case.inputs(2, g)


@functools.cache
def _jacobians(name: str, subset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference J (n, k, P) of x1 and x2 on the module, float64."""
    module, _, x1, x2 = _model(name)
    case = CASES[name]
    params = list(case.subset) if subset else None
    return reference_jacobian(module, x1, params, case.select), reference_jacobian(module, x2, params, case.select)


def _expected(name: str, mode: KernelMode, with_x2: bool, subset: bool = False) -> torch.Tensor:
    j1, j2 = _jacobians(name, subset)
    return reference_kernel(j1, j2 if with_x2 else j1, mode.value)


@pytest.mark.parametrize("name", _CASES)
def test_program_kernels_equal_the_reference_in_every_implementation_and_mode(name: str) -> None:
    _, program, x1, x2 = _model(name)
    output = CASES[name].output
    for implementation in IMPLEMENTATIONS:
        for mode in KernelMode:
            for with_x2 in (True, False) if implementation is NtkImplementation.STRUCTURED else (True,):
                other = None if mode is KernelMode.EXAMPLE_DIAGONAL or not with_x2 else x2
                result = compute_ntk(
                    program, x1, other, mode=mode, implementation=implementation, output=output, dtype=torch.float64
                )
                assert_matches(result.theta, _expected(name, mode, other is not None), 1e-10)


@pytest.mark.parametrize("name", _CASES)
def test_program_subsets_and_groups_equal_the_reference(name: str) -> None:
    module, program, x1, x2 = _model(name)
    case = CASES[name]
    for implementation in (NtkImplementation.STRUCTURED, NtkImplementation.JACOBIAN_CONTRACTION):
        for mode in (KernelMode.FULL, KernelMode.TRACE):
            theta = compute_ntk(
                program, x1, x2, mode=mode, params=list(case.subset), implementation=implementation,
                output=case.output, dtype=torch.float64,
            ).theta  # fmt: skip
            assert_matches(theta, _expected(name, mode, True, subset=True), 1e-10)
        result = compute_ntk_groups(
            program, x1, x2, groups="modules", implementation=implementation, output=case.output, dtype=torch.float64
        )
        j1, j2 = _jacobians(name, False)
        for group, members in result.parameters.items():
            columns = reference_columns(module, members)
            expected = reference_kernel(j1[..., columns], j2[..., columns], "full")
            assert_matches(result.thetas[group], expected, 1e-10)


@functools.cache
def _reports(name: str) -> tuple[PathReport, PathReport]:
    module, program, x1, _ = _model(name)
    output = CASES[name].output
    return describe_paths(module, x1, output=output), describe_paths(program, x1, output=output)


@pytest.mark.parametrize("name", _CASES)
def test_module_and_program_take_the_same_structured_paths(name: str) -> None:
    """The same rules read the module's forward and the program's graph: every parameter takes the same form on
    both, none is left to per-example autograd, and the capture is the same."""
    module_report, program_report = _reports(name)
    forms = [(p.name, p.form) for p in module_report.parameters]
    assert forms == [(p.name, p.form) for p in program_report.parameters]
    assert all(p.structured for p in program_report.parameters), [
        p for p in program_report.parameters if not p.structured
    ]
    assert module_report.capture == program_report.capture


def test_a_transformers_attention_projections_and_mlp_are_structured() -> None:
    """nn.TransformerEncoderLayer calls F.multi_head_attention_forward, which the engine runs as its ops: the packed
    input projection and the output projection are linear uses, like the MLP's, on the module and the program."""
    for report in _reports("transformer"):
        by_group = {g.group: g for g in report.groups()}
        for group in ("encoder.0.self_attn", "encoder.0.self_attn.out_proj", "encoder.0.linear1", "encoder.0.linear2"):
            assert by_group[group].ops == ("linear",) and by_group[group].form in ("factored", "jacobian")
        assert by_group["encoder.0.self_attn"].parameters == ("in_proj_weight", "in_proj_bias")
        assert report.capture.startswith("batched")  # (T, n, d) and (T·n, d) layouts keep the examples apart


def test_ntk_parameterization_takes_the_chain_as_nn_linear_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """NtkLinear's forward is F.linear on its parameters times numbers: a pipeline of them is captured in closed form
    on the module and on the program, and the kernel is the reference's."""
    runs: list[int] = []
    real = structured_capture.run_chain
    monkeypatch.setattr(structured_capture, "run_chain", lambda *args: runs.append(1) or real(*args))
    module, program, x1, x2 = _model("ntk_mlp")
    for model in (module, program):
        theta = compute_ntk(model, x1, x2, implementation="structured", dtype=torch.float64).theta
        assert_matches(theta, _expected("ntk_mlp", KernelMode.FULL, True), 1e-10)
    assert len(runs) == 2
    forms = [(p.name, p.form) for p in _reports("ntk_mlp")[1].parameters]
    assert forms == [("0.weight", "factored"), ("0.bias", "factored"), ("2.weight", "factored"), ("2.bias", "factored")]
