"""Where the structured NTK gets its inputs: per block of n examples, every covered call's input a and the
cotangents δ of all k outputs at its output, by the first strategy of ``CAPTURES`` that applies.

``CAPTURES`` is an ordered table, like the rules: each strategy has ``applies(problem, terms, options)`` and
``run(problem, terms, options, x)``, which returns the ``Capture`` (typed descriptors: each δ with its declared
layout and whether it is shared by all examples) and the plan it ran under (a new one when an assumption of the
old failed). The table, fastest first:

================== ========================================================== ====================================
strategy           when                                                        how
================== ========================================================== ====================================
chain              the model is a pure pipeline of Linear layers and            closed form, no autograd
                   activations (``StructuredOptions.chain``)                   (NOTE [sequential chains])
conv passes        batch safe, a convolution (``conv_passes``)                 k plain reverse passes
batched            batch safe (``batched_capture``)                            one reverse pass batched over k
per example        always                                                      vmap(jacrev) w.r.t. the probes
================== ========================================================== ====================================

Shapes: x (n, *input); inputs[i] (n, *in_shape_i), δ_i (n, k, *out_shape_i) with the per-example leading 1 of
the plan's shapes; fallback Jacobians (n, k, p).

NOTE [probes]: δ comes from one reverse pass per example, vmapped over the output basis: each site's output (the
output of an op call a rule covers) gets a zero "probe" added by the capture's ``Recorder`` mode, and ``jacrev``
w.r.t. the probes gives ∂f_c/∂(op output) for all c at once; the ops' inputs come back as auxiliary outputs.
Running per example under ``vmap`` (rather than on the batch) keeps the example axis out of the ops' view, so a
model that reshapes or transposes its batch internally still gets per-example a and δ. Parameters on the Jacobian
path are differentiated in the same pass. When ``recorder.batch_axes`` shows (on two different real examples) that
every site keeps the examples apart in a batched forward (and where: ``descriptors.Axis``), and no parameter is on
the Jacobian path, the same probes run on the batched forward with plain autograd instead
(``autograd.grad(..., is_grads_batched=True)``), each site's tensors seen per example through their axis: the same
numbers with less overhead (``StructuredOptions.batched_capture``). The mode is torch's thread-local mode stack:
other threads using the same module see nothing.

NOTE [channels-last capture]: a convolutional model's batched capture runs k plain reverse passes, and each pass is
mostly the input gradients of its convolutions (transposed convolutions over n images). oneDNN computes those on
NCHW tensors through internal reorders to and from its blocked layout, and on channels-last (NHWC) tensors directly
(``StructuredOptions.channels_last``). So the capture's mode gives every 2-D convolution its input in channels-last
memory (so oneDNN's output is channels-last too) and hands on every such output but the last in that layout
(same values: the model sees the same tensors, and the elementwise ops after it keep the layout), and
``ChannelsLastGrad`` hands the cotangent back to every convolution in that layout, so its backward, and the
elementwise backward before it, see one layout. The last convolution's output stays NCHW: what follows it is usually
a flatten or a pooling head, whose backward gives NCHW cotangents. A δ that comes back channels-last goes into
memory (n, H, W, k, C) (``_delta_buffer``), which ``ConvRule`` reads in place. A model that ``.view``s an inner
convolution's output cannot take channels-last strides: the first such failure yields a plan without that layout and
the capture reruns in NCHW.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.func import jacrev, vmap

from ntk_service.kernels.problem.batch import Batch, batch_size
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.chain import run_chain
from ntk_service.kernels.structured.descriptors import Capture, Delta, Layout, SiteAxes
from ntk_service.kernels.structured.options import StructuredOptions
from ntk_service.kernels.structured.plan import StructuredTerms
from ntk_service.kernels.structured.recorder import Recorder, run_recorded
from ntk_service.kernels.types import NamedTensors

__all__ = ["CAPTURES", "CaptureStrategy", "capture"]


class CaptureStrategy(Protocol):
    """One way to capture a block; ``CAPTURES`` lists them in the order they are tried."""

    name: str

    def applies(self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions) -> bool:
        """Whether this strategy captures blocks of ``problem`` under ``terms`` exactly."""
        ...

    def run(
        self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
    ) -> tuple[Capture, StructuredTerms]:
        """The capture of x (n, *input) and the plan it ran under (``terms`` or a new one it learned)."""
        ...


def _batched_layout(axes: SiteAxes, n: int, k: int) -> Layout | None:
    """The layout of a δ from a reverse pass batched over the output basis, (k, *batched shape) memory, seen as
    (n, k, *out): output-major when the examples lead the batched shape (else None: read from the tensor)."""
    if n == 1 or k == 1:
        return Layout.EXAMPLE_MAJOR
    return Layout.OUTPUT_MAJOR if axes.output.dim == 0 and axes.output.major else None


def _zeros(n: int, k: int, shape: tuple[int, ...], dtype: torch.dtype) -> Delta:
    """δ of a site no output depends on: zeros (n, k, *shape)."""
    return Delta(torch.zeros((n, k, *shape), dtype=dtype), Layout.EXAMPLE_MAJOR)


def _batched_inputs(recorder: Recorder, axes: tuple[SiteAxes, ...], n: int) -> list[torch.Tensor]:
    """Each site's input of the batched forward as (n, *in_shape) (a view; an empty (n, 0) without one)."""
    inputs = []
    for a, site_axes in zip(recorder.inputs, axes, strict=True):
        if a is None or site_axes.input is None:
            inputs.append(torch.empty(n, 0))
        else:
            inputs.append(site_axes.input.examples(a.detach(), n))
    return inputs


class ChainCapture:
    """The closed form of ``run_chain`` (NOTE [sequential chains]), while no module hook is registered."""

    name = "chain"

    def applies(self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions) -> bool:
        chain = terms.plan.chain
        return options.chain and chain is not None and chain.is_runnable()

    def run(
        self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
    ) -> tuple[Capture, StructuredTerms]:
        assert terms.plan.chain is not None and isinstance(x, torch.Tensor)  # chains take one tensor (coverage.py)
        inputs, deltas = run_chain(terms.plan.chain, x, len(terms.plan.sites))
        return Capture(inputs=inputs, deltas=deltas, fallback_jacobians={}), terms


def _batch_safe(terms: StructuredTerms, options: StructuredOptions) -> bool:
    return options.batched_capture and bool(terms.batch_safe) and terms.axes is not None


class ConvPassesCapture:
    """A convolutional model's batched capture: k plain reverse passes, one per output, each written into its
    slot of the deltas' memory (vmap's convolution_backward rule, which ``is_grads_batched`` would use, clones its
    inputs and loops over the outputs, then concatenates); channels-last where the model allows (NOTE
    [channels-last capture])."""

    name = "conv passes"

    def applies(self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions) -> bool:
        convs = any(site.family in ("conv", "convolution") for site in terms.plan.sites)
        return _batch_safe(terms, options) and options.conv_passes and convs

    def run(
        self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
    ) -> tuple[Capture, StructuredTerms]:
        # NOTE [channels-last capture] was measured on oneDNN: the CPU only
        if options.channels_last and terms.channels_last and isinstance(x, torch.Tensor) and x.device.type == "cpu":
            try:
                return self._once(problem, terms, x, channels_last=True), terms
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # e.g. the model views a convolution's output: .view needs NCHW strides
                terms = terms.learned(channels_last=False)
        return self._once(problem, terms, x, channels_last=False), terms

    @staticmethod
    def _once(problem: NtkProblem, terms: StructuredTerms, x: Batch, *, channels_last: bool) -> Capture:
        n, k, plan = batch_size(x), problem.k, terms.plan
        assert terms.axes is not None
        recorder = Recorder(problem, plan, n, axes=terms.axes, channels_last=channels_last)
        with torch.enable_grad():
            out = run_recorded(problem, recorder, problem.params, x)  # (n, k)
            head = recorder.output_use(out)  # its δ is the basis: no pass needed
            passes = [i for i in range(len(recorder.probes)) if i != head]
            buffers: list[torch.Tensor | None] = [None] * len(recorder.probes)
            eye = torch.eye(k, dtype=problem.dtype)
            for c in range(k if passes else 0):
                cotangent = eye[c].expand(n, k)
                probes = [recorder.probes[i] for i in passes]
                grads = torch.autograd.grad(out, probes, cotangent, retain_graph=c < k - 1, allow_unused=True)
                for i, g in zip(passes, grads, strict=True):
                    if g is None:
                        continue
                    g = terms.axes[i].output.examples(g, n)  # (n, *out_shape)
                    buffer = buffers[i]
                    if buffer is None:  # earlier passes gave no cotangent: zeros
                        buffer = buffers[i] = _delta_buffer(g, k)
                        buffer[:, :c].zero_()
                    buffer[:, c].copy_(g)
        deltas = [
            _basis(eye, n)
            if i == head
            else _zeros(n, k, plan.sites[i].out_shape, problem.dtype)
            if b is None
            else Delta(b, Layout.EXAMPLE_MAJOR)
            for i, b in enumerate(buffers)
        ]
        return Capture(_batched_inputs(recorder, terms.axes, n), deltas, {})


class BatchedCapture:
    """NOTE [probes]: one batched forward and one reverse pass batched over the output basis
    (``autograd.grad(..., is_grads_batched=True)``)."""

    name = "batched"

    def applies(self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions) -> bool:
        return _batch_safe(terms, options)

    def run(
        self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
    ) -> tuple[Capture, StructuredTerms]:
        n, k, plan = batch_size(x), problem.k, terms.plan
        axes = terms.axes
        assert axes is not None
        recorder = Recorder(problem, plan, n, axes=axes)
        with torch.enable_grad():
            out = run_recorded(problem, recorder, problem.params, x)  # (n, k)
            head = recorder.output_use(out)  # its δ is the basis: not asked of the reverse pass
            passes = [i for i in range(len(recorder.probes)) if i != head]
            eye = torch.eye(k, dtype=problem.dtype)
            # a materialized basis: the batched matmul of a Linear output layer's backward then folds k into its
            # rows (one mm) instead of an expanded bmm
            basis = eye.unsqueeze(1).expand(k, n, k).contiguous()
            probes = [recorder.probes[i] for i in passes]
            found = torch.autograd.grad(out, probes, basis, is_grads_batched=True, allow_unused=True) if probes else ()
            grads = dict(zip(passes, found, strict=True))
        deltas = []
        for i, site in enumerate(plan.sites):
            if i == head:
                deltas.append(_basis(eye, n))
            elif grads[i] is None:
                deltas.append(_zeros(n, k, site.out_shape, problem.dtype))
            else:  # (k, *batched) -> (n, k, *out_shape), views
                d = axes[i].output.examples(grads[i], n, lead=1).transpose(0, 1)
                layout = _batched_layout(axes[i], n, k)
                deltas.append(Delta(d, Layout.of(d) if layout is None else layout))
        return Capture(_batched_inputs(recorder, axes, n), deltas, {}), terms


class PerExampleCapture:
    """NOTE [probes]: per example under vmap, ``jacrev`` w.r.t. the probes (and the fallback parameters)."""

    name = "per example"

    def applies(self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions) -> bool:
        return True

    def run(
        self, problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
    ) -> tuple[Capture, StructuredTerms]:
        n, k, plan = batch_size(x), problem.k, terms.plan
        recorder = Recorder(problem, plan)
        probes = tuple(torch.zeros(s.out_shape, dtype=problem.dtype) for s in plan.sites)
        fallback = {name: problem.params[name] for name in plan.fallback}
        constants = {name: t for name, t in problem.params.items() if name not in fallback}

        def forward(
            probe_args: tuple[torch.Tensor, ...], fallback_args: NamedTensors, x_i: torch.Tensor
        ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            recorder.probes, recorder.inputs = list(probe_args), []
            out = run_recorded(problem, recorder, {**constants, **fallback_args}, x_i)
            inputs = tuple(torch.empty(0) if a is None else a for a in recorder.inputs)
            return out, inputs

        with torch.enable_grad():
            (d_probes, d_fallback), inputs = vmap(jacrev(forward, argnums=(0, 1), has_aux=True), (None, None, 0))(
                probes, fallback, x
            )
        capture = Capture(
            inputs=list(inputs),
            deltas=[Delta(d, Layout.of(d)) for d in d_probes],  # vmap's layout: read once, here
            fallback_jacobians={name: j.reshape(n, k, -1) for name, j in d_fallback.items()},
        )
        return capture, terms


CAPTURES: tuple[CaptureStrategy, ...] = (ChainCapture(), ConvPassesCapture(), BatchedCapture(), PerExampleCapture())
"""Every capture strategy, tried in order; the first that applies captures the block."""


def capture(
    problem: NtkProblem, terms: StructuredTerms, options: StructuredOptions, x: Batch
) -> tuple[Capture, StructuredTerms]:
    """The block's capture by the first strategy of ``CAPTURES`` that applies, and the plan it ran under.

    Args:
        problem: the prepared model.
        terms: its plan (``batch_safe`` decided for the batched strategies to apply).
        options: the engine's switches.
        x: (n, *input).

    Returns:
        The capture (inputs[i] (n, *in_shape), deltas[i] (n, k, *out_shape) for use i; fallback name -> (n, k, p))
        and the plan (``terms``, or a new one when the capture learned a fact: NOTE [channels-last capture]).
    """
    strategy = next(s for s in CAPTURES if s.applies(problem, terms, options))
    return strategy.run(problem, terms, options, x)


def _basis(eye: torch.Tensor, n: int) -> Delta:
    """δ of the site whose output is the model's output: e_c for output c of every example, the identity expanded
    over the examples (stride 0), (n, k, 1, k), declared shared (NOTE [example-independent δ] in contraction.py)."""
    return Delta(eye.unsqueeze(0).expand(n, *eye.shape).unsqueeze(2), Layout.EXAMPLE_MAJOR, shared=True)


def _delta_buffer(grad: torch.Tensor, k: int) -> torch.Tensor:
    """Uninitialised δ (n, k, *grad.shape[1:]) for the k reverse passes of ``ConvPassesCapture``, grad (n, *out).

    A channels-last cotangent (n, 1, C, H, W) gets memory (n, H, W, k, C): each example's δ is then an (H·W, k·C)
    matrix, so a convolution's weight Jacobian is one batched matmul with its patches and the bias a sum over
    the outer axes (NOTE [channels-last capture]); others get (n, k, ...).
    """
    n, *shape = grad.shape
    if grad.ndim == 5 and shape[0] == 1:
        image = grad[:, 0]
        if image.is_contiguous(memory_format=torch.channels_last) and not image.is_contiguous():
            _, c, h, w = shape
            return torch.empty((n, h, w, k, c), dtype=grad.dtype).permute(0, 3, 4, 1, 2).unsqueeze(2)
    return torch.empty((n, k, *shape), dtype=grad.dtype)
