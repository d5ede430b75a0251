"""torch's OpenMP threads on a shared machine: the wait policy ``import ntk_service`` sets, and the advice it gives.

NOTE [OpenMP wait policy]
libgomp's default waiting spins: a thread that reaches a barrier first burns its core until its partners arrive.
On a machine busier than its cores the partner is often descheduled, so every parallel torch op waits out a
scheduler slice. Measured (``benchmarks/bench_shared_machine.py``; docs/benchmarks.md): ``compute_ntk`` of an MLP at
N = 64 ran about 10x slower beside two torch processes running their own 2-thread loops, and not slower beside a
plain Python busy loop (which does not spin). ``OMP_WAIT_POLICY=PASSIVE`` makes waiting threads sleep instead;
libgomp reads it once, when torch loads it, so it must be in the environment before ``import torch``.

``import ntk_service`` (any submodule imports the package first) therefore sets ``OMP_WAIT_POLICY=PASSIVE`` when
torch is not loaded yet and the variable is unset: an explicit setting, even an empty one, is the user's and wins.
When torch was loaded first nothing can change the policy any more; if the machine is busier than its cores at that
moment, a ``RuntimeWarning`` says so and what to do. The decision is the pure function :func:`wait_policy_plan` of
explicit inputs (environment, whether torch is loaded, load average, cores); :func:`apply_wait_policy` applies it
to this process once, at import.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["WaitPolicyPlan", "apply_wait_policy", "wait_policy_plan"]

VARIABLE = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class WaitPolicyPlan:
    """What ``import ntk_service`` does about the OpenMP wait policy.

    Attributes:
        set_passive: put ``OMP_WAIT_POLICY=PASSIVE`` into the environment (torch not loaded, variable unset).
        warning: a message for the user (torch already loaded with the default policy on a busy machine), or None.
    """

    set_passive: bool
    warning: str | None


def wait_policy_plan(
    environ: Mapping[str, str], *, torch_loaded: bool, load_average: float | None, cores: int | None
) -> WaitPolicyPlan:
    """Decide what to do about the wait policy (NOTE [OpenMP wait policy]).

    Args:
        environ (Mapping[str, str]): the process environment.
        torch_loaded (bool): whether ``torch`` is imported already (then libgomp has read the policy).
        load_average (float | None): the 1-minute load average, or None where the system has none.
        cores (int | None): the CPUs this process may run on, or None when unknown.

    Returns:
        WaitPolicyPlan: set the variable when it is unset and torch is not loaded; a warning when it is unset, torch
        is loaded and the load is above the cores; otherwise nothing.
    """
    if VARIABLE in environ:
        return WaitPolicyPlan(set_passive=False, warning=None)
    if not torch_loaded:
        return WaitPolicyPlan(set_passive=True, warning=None)
    if load_average is None or cores is None or load_average <= cores:
        return WaitPolicyPlan(set_passive=False, warning=None)
    return WaitPolicyPlan(
        set_passive=False,
        warning=(
            f"ntk_service: torch was imported before ntk_service with {VARIABLE} unset, and this machine is busier "
            f"than its cores (load average {load_average:.1f} on {cores}): torch's OpenMP threads spin while they "
            "wait, and kernels can run 10x slower. Set OMP_WAIT_POLICY=PASSIVE in the environment before Python "
            "starts (or import ntk_service before torch), or call torch.set_num_threads(1)"
        ),
    )


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> WaitPolicyPlan:
    """Apply :func:`wait_policy_plan` to this process: set the variable, or warn (``RuntimeWarning``).

    Args:
        environ (MutableMapping[str, str] | None): the environment to read and change. Default: ``os.environ``.

    Returns:
        WaitPolicyPlan: what was done.
    """
    target = os.environ if environ is None else environ
    plan = wait_policy_plan(target, torch_loaded="torch" in sys.modules, load_average=_load_average(), cores=_cores())
    if plan.set_passive:
        target[VARIABLE] = "PASSIVE"
    if plan.warning is not None:
        warnings.warn(plan.warning, RuntimeWarning, stacklevel=3)
    return plan


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none; some containers cannot read it
        return None


def _cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()
