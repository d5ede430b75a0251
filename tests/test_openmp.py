"""NOTE [OpenMP wait policy]: ``import ntk_service`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` unless the user
set it; after torch, on a machine busier than its cores, it warns and says what to do. The decision is a pure
function of explicit inputs; the import itself is checked in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ntk_service._openmp import wait_policy_plan


@pytest.mark.parametrize(
    ("environ", "torch_loaded", "load", "set_passive", "warns"),
    [
        ({}, False, 9.0, True, False),  # before torch: set it, whatever the load
        ({}, True, 1.0, False, False),  # after torch on a quiet machine: nothing to say
        ({}, True, 2.0, False, False),  # load equal to the cores is not busier than them
        ({}, True, 9.0, False, True),  # after torch on a busy machine: too late to set, so say so
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False, 9.0, False, False),  # the user's setting wins
        ({"OMP_WAIT_POLICY": ""}, True, 9.0, False, False),  # even an empty one
        ({}, True, None, False, False),  # no load average (Windows): no guess
    ],
)
def test_wait_policy_plan(
    environ: dict[str, str], torch_loaded: bool, load: float | None, set_passive: bool, warns: bool
) -> None:
    plan = wait_policy_plan(environ, torch_loaded=torch_loaded, load_average=load, cores=2)
    assert plan.set_passive is set_passive
    assert (plan.warning is not None) is warns
    if warns:
        assert plan.warning is not None
        assert "load average 9.0 on 2" in plan.warning and "OMP_WAIT_POLICY=PASSIVE" in plan.warning
        assert "import ntk_service before torch" in plan.warning and "torch.set_num_threads(1)" in plan.warning


_PROBE = """
import json, os, sys, warnings
warnings.simplefilter("error")
{imports}
import torch
print(json.dumps({{"policy": os.environ.get("OMP_WAIT_POLICY"), "torch": "torch" in sys.modules}}))
"""


def _probe(imports: str, **environ: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | environ
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(imports=imports)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_importing_ntk_service_before_torch_sets_passive_unless_the_user_chose() -> None:
    assert _probe("import ntk_service")["policy"] == "PASSIVE"
    assert _probe("from ntk_service.kernels import compute_ntk")["policy"] == "PASSIVE"  # a submodule, too
    assert _probe("import ntk_service", OMP_WAIT_POLICY="ACTIVE")["policy"] == "ACTIVE"
