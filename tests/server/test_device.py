"""NTK_DEVICE: parsed by Settings, checked when the server starts (a real server process refuses an absent GPU),
and named by /readyz (the kernel routes compute on it: tests/gpu/test_cuda.py on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from ntk_service.config import Settings
from ntk_service.server import create_app
from tests.conftest import start_live_server

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_device_defaults_to_cpu_and_tf32_to_off(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert (settings.device, settings.allow_tf32) == ("cpu", False)
    assert Settings(device=" CUDA:1 ").device == "cuda:1"


def test_device_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NTK_DEVICE", "cuda")
    monkeypatch.setenv("NTK_ALLOW_TF32", "true")
    assert (Settings().device, Settings().allow_tf32) == ("cuda", True)


@pytest.mark.parametrize("text", ["gpu", "cuda:one", "tpu:0", ""])
def test_a_malformed_device_is_refused_by_settings(text: str) -> None:
    with pytest.raises(ValidationError, match=r"NTK_DEVICE: .* is not a device; use 'cpu', 'cuda' or 'cuda:N'"):
        Settings(device=text)


@NO_CUDA
def test_create_app_refuses_cuda_where_it_is_absent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"serve: NTK_DEVICE: device 'cuda:0' was asked for but CUDA is not available"):
        create_app(Settings(data_dir=tmp_path, api_keys="k:read", device="cuda:0"))


@pytest.mark.slow  # a server process imports torch before it can refuse: seconds
@NO_CUDA
def test_a_real_server_asked_for_cuda_exits_at_startup_saying_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="server exited with 1 during startup") as info:
        start_live_server(tmp_path / "data", device="cuda")
    message = str(info.value)
    assert "device 'cuda' was asked for but CUDA is not available here" in message
    assert "use device 'cpu' (NTK_DEVICE=cpu)" in message
