"""The benchmark's ResNet and transformer (benchmarks/_models.py), at small shapes, in every implementation × mode
against the independent float64 reference; and attention's math path for forward-mode AD (math_attention)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._models import MODELS, ResNet, TransformerClassifier, make_inputs, randomize_batchnorm
from ntk_service.kernels import KernelMode, NtkImplementation, compute_ntk
from ntk_service.kernels.choice import ALGORITHMS, plan_choice
from ntk_service.kernels.problem.math_attention import math_attention
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from tests.reference import assert_matches, reference_ntk

pytestmark = pytest.mark.filterwarnings(
    # torch has no vmap batching rule for CPU flash attention (nn.MultiheadAttention): correct, slower, warned
    "ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning"
)

IMPLEMENTATIONS = [*ALGORITHMS, NtkImplementation.AUTO]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny kernels: one intra-op thread avoids thread wake-ups that dominate on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The benchmark architecture at small shapes (same classes, so the same layers and forward)."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    if name == "resnet":
        model: nn.Module = randomize_batchnorm(ResNet(widths=(2, 3, 4), in_channels=2, k=3), g).eval()
        return model, torch.randn(3, 2, 6, 6, generator=g), torch.randn(2, 2, 6, 6, generator=g)
    model = TransformerClassifier(vocab=11, max_len=5, d=8, heads=4, d_ff=12, layers=2, k=3).eval()
    return model, torch.randint(0, 11, (3, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g)


@functools.cache
def _reference(name: str, mode: KernelMode, with_x2: bool) -> torch.Tensor:
    model, x1, x2 = _case(name)
    return reference_ntk(model, x1, x2 if with_x2 else None, mode.value)


@pytest.mark.parametrize("name", ["resnet", "transformer"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=str)
@pytest.mark.parametrize("mode", list(KernelMode), ids=str)
def test_benchmark_models_match_the_reference(name: str, implementation: NtkImplementation, mode: KernelMode) -> None:
    model, x1, x2 = _case(name)
    for with_x2 in (True, False):
        result = compute_ntk(
            model, x1, x2 if with_x2 else None, mode=mode, implementation=implementation, dtype=torch.float64
        )
        if implementation is not NtkImplementation.AUTO:
            assert result.implementation is implementation
        assert_matches(result.theta, _reference(name, mode, with_x2), 1e-10)


@pytest.mark.parametrize(
    ("name", "winner"),
    [("resnet", NtkImplementation.JACOBIAN_CONTRACTION), ("transformer", NtkImplementation.JACOBIAN_CONTRACTION)],
)
def test_auto_picks_the_measured_winner_on_the_benchmark_models(name: str, winner: NtkImplementation) -> None:
    """At N = M = 32, FULL and TRACE, AUTO's cost model picks what benchmarks/bench_real_models.py measured as
    fastest of our implementations (docs/engine.md): the plain contraction on both (on the transformer
    structured's per-example capture took 1.07-1.09x its time at N = M = 32: NOTE [auto choice] in api.py). Planning
    only: no kernel is computed."""
    model = MODELS[name]()
    x = make_inputs(name, 4)
    with prepared_problem(model, x, x, params=None, dtype=None) as prepared:
        for mode in (KernelMode.FULL, KernelMode.TRACE):
            alg, _, _ = plan_choice(NtkImplementation.AUTO, (prepared.problem, 32, 32, mode, False), 2**34)
            assert alg.implementation is winner, mode


def test_math_attention_gives_forward_ad_to_multihead_attention_in_eval_mode() -> None:
    """jvp through MultiheadAttention's fused eval path fails; under math_attention it equals central differences
    and the output is the fused path's, and a direct scaled_dot_product_attention call is the math kernel's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    params = {k: v.detach() for k, v in mha.named_parameters()}
    tangent = {k: torch.randn_like(v) for k, v in params.items()}

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(mha, p, (x, x, x))[0]
        return out

    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(f, (params,), (tangent,))
    with math_attention():
        out, derivative = torch.func.jvp(f, (params,), (tangent,))
        sdpa = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    eps = 1e-6
    plus = f({k: params[k] + eps * tangent[k] for k in params})
    minus = f({k: params[k] - eps * tangent[k] for k in params})
    assert float((derivative - (plus - minus) / (2 * eps)).abs().max()) < 1e-8
    assert float((out - f(params)).abs().max()) < 1e-14
    scores = (x @ x.transpose(1, 2)) / 8**0.5 + torch.full((5, 5), float("-inf"), dtype=x.dtype).triu(1)
    assert float((sdpa - scores.softmax(-1) @ x).abs().max()) < 1e-14


def test_math_attention_is_local_to_its_thread_and_block() -> None:
    """Other threads and code after the block keep torch's own dispatch (the mode stack is thread-local)."""
    seen: list[bool] = []
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        seen.append(torch.overrides._get_current_function_mode_stack() == [])
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with math_attention():
        inside = len(torch.overrides._get_current_function_mode_stack()) == 1
        entered.set()
        release.wait(10)
    thread.join()
    assert inside and seen == [True]
    assert torch.overrides._get_current_function_mode_stack() == []
