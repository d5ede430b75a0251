"""Device plumbing on every machine: device strings, refusals, budgets per device, placement, the TF32 policy.

What needs a GPU (kernels on CUDA, the per-call copy of a CPU model to the GPU) is in tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, UnknownDevice
from ntk_service.kernels import compute_ntk, device_memory_budget, model_device, parse_device, place_module, warm_up
from ntk_service.kernels.runtime.device import MEMORY_BUDGETS, Tf32Policy, cuda_memory_budget, host_memory_budget
from tests.reference import assert_matches, reference_ntk

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.mark.parametrize(
    ("text", "count", "expected"),
    [
        ("cpu", 0, torch.device("cpu")),
        (" CPU ", 0, torch.device("cpu")),
        ("cpu:0", 0, torch.device("cpu")),
        (torch.device("cpu"), 0, torch.device("cpu")),
        (None, 0, torch.device("cpu")),
        ("cuda", 1, torch.device("cuda", 0)),
        ("cuda:1", 2, torch.device("cuda", 1)),
        ("CUDA:0", 4, torch.device("cuda", 0)),
    ],
)
def test_device_strings_parse(text: object, count: int, expected: torch.device) -> None:
    assert parse_device(text, cuda_devices=count) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["tpu", "gpu", "cuda:x", "cuda:-1", "cpu:1", "", "cuda:", "mps"])
def test_unknown_device_strings_are_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(UnknownDevice, match=r"is not supported; use 'cpu', 'cuda' or 'cuda:N'") as info:
        parse_device(text, cuda_devices=8)
    assert isinstance(info.value, InvalidInput) and info.value.http_status == 422


def test_cuda_without_gpus_says_cuda_is_absent_and_how_to_fix_it() -> None:
    with pytest.raises(UnknownDevice, match=r"device 'cuda:0' was asked for but CUDA is not available here") as info:
        parse_device("cuda:0", cuda_devices=0, operation="serve: NTK_DEVICE")
    assert info.value.message.startswith("serve: NTK_DEVICE: ")
    assert "use device 'cpu' (NTK_DEVICE=cpu)" in info.value.message


def test_cuda_index_past_the_visible_devices_is_refused() -> None:
    expected = r"'cuda:2' does not exist: 2 CUDA device\(s\) visible \(cuda:0 to cuda:1\)"
    with pytest.raises(UnknownDevice, match=expected):
        parse_device("cuda:2", cuda_devices=2)


@NO_CUDA
def test_this_machine_refuses_cuda_before_any_work() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(UnknownDevice, match="CUDA is not available here"):
        compute_ntk(model, torch.randn(2, 3), device="cuda")
    with pytest.raises(UnknownDevice, match="CUDA is not available here"):
        warm_up("cuda")
    with pytest.raises(UnknownDevice, match="is not supported"):
        compute_ntk(model, torch.randn(2, 3), device="tpu")


@pytest.fixture(scope="module")
def small_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 CNN, x1 (4, 2, 6, 6), x2 (3, 2, 6, 6) and their reference kernel (4, 3, 3, 3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    x1, x2 = torch.randn(4, 2, 6, 6, dtype=torch.float64), torch.randn(3, 2, 6, 6, dtype=torch.float64)
    return model, x1, x2, reference_ntk(model, x1, x2)


@pytest.mark.parametrize(
    ("implementation", "device"),
    [
        ("jacobian_contraction", "cpu"),
        ("ntk_vector_products", "cpu"),
        ("structured", "cpu"),
        ("auto", torch.device("cpu")),
    ],
)
def test_a_kernel_on_device_cpu_equals_the_reference(
    small_cnn: tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], implementation: str, device: object
) -> None:
    model, x1, x2, expected = small_cnn
    result = compute_ntk(model, x1, x2, implementation=implementation, device=device)  # type: ignore[arg-type]
    assert result.theta.device == torch.device("cpu")
    assert_matches(result.theta, expected)


def test_model_device_and_placement_copy_without_touching_the_model() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.BatchNorm1d(3)).eval()  # tied weights and a buffer
    assert model_device(model) == torch.device("cpu")
    assert model_device(nn.Tanh()) == torch.device("cpu")  # no tensors
    before = {name: t.clone() for name, t in model.state_dict().items()}
    placed = place_module(model, torch.device("cpu"))
    assert placed is not model and model_device(placed) == torch.device("cpu")
    assert placed[0] is placed[2]  # tied weights stay tied, and counted once
    assert len(list(placed.parameters())) == len(list(model.parameters())) == 4
    for (name, t), (_, p) in zip(model.state_dict().items(), placed.state_dict().items(), strict=True):
        assert torch.equal(t, p), name
        assert t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), name  # copies, not views
    with torch.no_grad():
        placed[0].weight.add_(1.0)
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_an_uncopyable_model_is_refused_with_a_way_out() -> None:
    model = nn.Linear(2, 2)
    model.lock = threading.Lock()  # deepcopy cannot copy a lock
    with pytest.raises(InvalidInput, match=r"cannot be copied to cpu .*model\.to\(device\)"):
        place_module(model, torch.device("cpu"))


def test_the_budget_source_is_chosen_by_the_device_kind() -> None:
    calls: list[tuple[str, torch.device]] = []

    def source(name: str, value: int) -> object:
        def read(device: torch.device) -> int:
            calls.append((name, device))
            return value

        return read

    sources = {"cpu": source("host", 1000), "cuda": source("gpu", 5000)}
    assert device_memory_budget(torch.device("cuda", 1), sources=sources) == 5000  # type: ignore[arg-type]
    assert device_memory_budget(torch.device("cpu"), sources=sources) == 1000  # type: ignore[arg-type]
    assert calls == [("gpu", torch.device("cuda", 1)), ("host", torch.device("cpu"))]  # never the other one
    with pytest.raises(UnknownDevice, match="no memory budget is known for device 'meta'"):
        device_memory_budget(torch.device("meta"), sources=sources)  # type: ignore[arg-type]


def test_the_default_budget_table_keeps_host_and_gpu_apart() -> None:
    assert dict(MEMORY_BUDGETS) == {"cpu": host_memory_budget, "cuda": cuda_memory_budget}
    assert device_memory_budget(torch.device("cpu")) > 0


def test_tf32_policy_sets_and_restores_the_switches() -> None:
    matmul, cudnn = SimpleNamespace(allow_tf32=False), SimpleNamespace(allow_tf32=True)  # torch's defaults
    policy = Tf32Policy([(matmul, "allow_tf32"), (cudnn, "allow_tf32")])
    with policy(False):
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)  # TF32 off for convolutions too
        with policy(False):  # a concurrent computation that agrees joins at once
            pass
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
    assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, True)
    with policy(True):
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
    assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, True)


def test_tf32_policy_makes_a_disagreeing_computation_wait() -> None:
    switch = SimpleNamespace(allow_tf32=True)
    policy = Tf32Policy([(switch, "allow_tf32")])
    seen: list[bool] = []

    def other() -> None:
        with policy(True):
            seen.append(switch.allow_tf32)

    with policy(False):
        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.05)
        assert seen == [] and switch.allow_tf32 is False  # still waiting for this block to end
    thread.join(timeout=5)
    assert seen == [True] and switch.allow_tf32 is True  # restored after the last one


def test_tf32_policy_defaults_to_torchs_cuda_switches() -> None:
    policy = Tf32Policy()
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with policy(False):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
