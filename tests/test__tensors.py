"""``ntk_service._tensors.is_torch_tensor``: exact, and torch-free where torch was never imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import torch

from ntk_service._tensors import is_torch_tensor
from tests.conftest import REPO_ROOT


class _LooksLikeATensor:
    """What ``hasattr(x, "detach") and hasattr(x, "cpu")`` took for a tensor."""

    def detach(self) -> None: ...

    def cpu(self) -> None: ...


def test_only_torch_tensors_are_torch_tensors() -> None:
    assert is_torch_tensor(torch.zeros(2)) and is_torch_tensor(torch.nn.Parameter(torch.zeros(2)))
    assert not is_torch_tensor(np.zeros(2)) and not is_torch_tensor([1.0]) and not is_torch_tensor(_LooksLikeATensor())


def test_it_never_imports_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules.update(torch=None)
        from ntk_service._tensors import is_torch_tensor
        print(is_torch_tensor([1.0]), "torch" in sys.modules and sys.modules["torch"] is not None)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
