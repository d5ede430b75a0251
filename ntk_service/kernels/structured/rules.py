"""Structure rules of the structured-derivative NTK, keyed to operators: how the Jacobian of a parameter that enters
an op (``linear``, ``matmul``/``mm``/``addmm``, ``conv1d``/``conv2d``, ``embedding``, the affine parameters of
``layer_norm``/``rms_norm``/``group_norm``/eval ``batch_norm``, an elementwise scale or bias) follows from the op's
input a and the cotangents δ of the k outputs at its output, without differentiating w.r.t. the parameter.

A rule reads one call (``parse``: the bound arguments of the op, eager or ATen, see ``ops.py``) into a ``Call``: the
op's activation input, the parameters it takes in each role (``ParamMap``: which parameter, times which scale,
through which view of its elements) and a frozen ``config`` of what the math needs (strides, eps, ...). It then
sees one *use* (one call) for a block of n examples: ``a`` (n, *input of the call, per example) and ``delta``
(n, k, *output of the call, per example). A weight whose Jacobian is a sum of outer products over positions t (and
is block diagonal over groups g) returns ``Factors``:

    J_c = Σ_g Σ_t D_c[g, t] ⊗ A[g, t],      so   J1_c · J2_d = Σ_g Σ_{t,s} (D1_c[g,t] · D2_d[g,s]) (A1[g,t] · A2[g,s]),

which ``contraction.py`` contracts without ever forming J (the factored form) or turns into J with one batched
matmul (``factors_jacobian``), whichever its cost model says is cheaper. Parameters without factors (biases,
affine parameters of normalisations, elementwise operands) give J directly: J_b = Σ_t δ[t], J_w = Σ_t δ[t] ⊙ x̂[t].
Every J is in the layout of the tensor the op takes (``jacobians``); the engine maps it onto the parameter.

=================== ===================================== ==============================================
op                  A[g, t] (da)                           D_c[g, t] (dd)
=================== ===================================== ==============================================
linear, matmul      a[t] (in), t over leading positions    δ_c[t] (out)
conv1d / conv2d     patch[p] of group g (C_in/G·kh·kw)     δ_c[g, p] (C_out/G), p over output positions
embedding           one-hot(id[t]) (kept as ids)           δ_c[t] (embedding_dim), 0 at padding_idx
=================== ===================================== ==============================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ntk_service.kernels.structured.descriptors import Layout
from ntk_service.kernels.structured.ops import Op

__all__ = [
    "RULES",
    "Call",
    "Factors",
    "ParamMap",
    "Rule",
    "factors_jacobian",
    "rule_for",
]


@dataclass(frozen=True, eq=False)
class ParamMap:
    """How the tensor an op takes follows from one selected parameter: ``scale`` times a view of its elements
    (plus constants, which do not change a Jacobian).

    Attributes:
        name: the parameter.
        numel: the parameter's number of elements.
        scale: the factor (``w * 0.5``, NTK parameterization's ``w · σ/√fan_in``).
        index: for each element of the op's tensor, the index of the parameter element it is (int64, the op
            tensor's shape); None: the op's tensor is the parameter itself, in its layout.
    """

    name: str
    numel: int
    scale: float = 1.0
    index: torch.Tensor | None = None

    def scaled(self, factor: float) -> ParamMap:
        """This map times ``factor``."""
        return ParamMap(self.name, self.numel, self.scale * factor, self.index)

    def same_view(self, other: ParamMap) -> bool:
        """Both take the parameter's elements in the same arrangement (scales aside)."""
        if self.index is None or other.index is None:
            return self.index is None and other.index is None
        return self.index.shape == other.index.shape and torch.equal(self.index, other.index)


Tracked = Callable[[object], ParamMap | None]
"""What the engine knows of an argument: the ``ParamMap`` of a tensor that follows from a selected parameter, else
None (an activation, a constant, a number)."""


@dataclass(frozen=True, eq=False)
class Call:
    """A rule's reading of one op call.

    Attributes:
        rule: the rule.
        config: what its math needs, frozen and hashable (never a tensor).
        input_arg: the bound name of the activation input a, or None when the rule needs none (a bias).
        params: role -> the parameter the op takes in that role.
        state: constant tensors the math needs (eval BatchNorm's running statistics), by name.
    """

    rule: Rule
    config: Hashable
    input_arg: str | None
    params: dict[str, ParamMap]
    state: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Factors:
    """J_c = Σ_g Σ_t D_c[g, t] ⊗ A[g, t] for a block of n examples.

    Attributes:
        a: (n, G, T, da) float; or (n, 1, T) int64 token ids when ``index`` (A = one-hot of the id).
        d: (n, k, G, T, dd).
        index: A is a one-hot vector given by its index.
    """

    a: torch.Tensor
    d: torch.Tensor
    index: bool = False


def factors_jacobian(f: Factors, rows: int = 0) -> torch.Tensor:
    """J from its factors, one batched matmul: (n, k, G·dd·da) in D-major order (a linear weight's (out, in)).

    Args:
        f: the factors.
        rows: the number of rows of A's one-hot (num_embeddings) when ``f.index``; unused otherwise.
    """
    n, k, g, t, dd = f.d.shape
    if f.index:
        onehot = F.one_hot(f.a.reshape(n, t), rows).to(f.d.dtype)  # (n, T, V)
        j = onehot.transpose(1, 2) @ f.d.reshape(n, k, t, dd).permute(0, 2, 1, 3).reshape(n, t, k * dd)
        return j.view(n, rows, k, dd).permute(0, 2, 1, 3).reshape(n, k, rows * dd)
    da = f.a.shape[-1]
    d = f.d.permute(0, 2, 1, 4, 3).reshape(n, g, k * dd, t)  # (n, G, k·dd, T)
    j = d @ f.a  # (n, G, k·dd, da)
    return j.view(n, g, k, dd, da).transpose(1, 2).reshape(n, k, g * dd * da)


def _sum_positions(delta: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Σ over every per-example axis but the channel one: delta (n, k, *out) -> (n, k, channels).

    Sums in place of δ's memory layout (no copy, whether it is (n, k, ...) or (k, n, ...)).
    """
    channel_dim %= delta.ndim
    others = tuple(d for d in range(2, delta.ndim) if d != channel_dim)
    return delta.sum(others) if others else delta


def _tensor(value: object) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _activation(bound: Mapping[str, Any], name: str, tracked: Tracked) -> torch.Tensor | None:
    """The argument ``name`` when it is a tensor no selected parameter flows into (an activation or constant)."""
    t = _tensor(bound.get(name))
    return t if t is not None and tracked(t) is None else None


def _affine_roles(bound: Mapping[str, Any], tracked: Tracked) -> dict[str, ParamMap]:
    """The ``weight`` and ``bias`` arguments a selected parameter flows into, by role."""
    roles = {}
    for role in ("weight", "bias"):
        t = _tensor(bound.get(role))
        mp = tracked(t) if t is not None else None
        if mp is not None:
            roles[role] = mp
    return roles


class Rule:
    """One operator family. ``factored``: the roles whose Jacobian has ``Factors``."""

    families: tuple[str, ...] = ()
    factored: tuple[str, ...] = ("weight",)

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        """The call as a use of this rule, or None when the rule does not cover it (then every parameter it takes
        is differentiated on the Jacobian path)."""
        raise NotImplementedError

    def factors(self, config: Any, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        """Factors of the weight's Jacobian for one use: a (n, *in), delta (n, k, *out)."""
        raise NotImplementedError

    def factor_dims(self, config: Any, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        """(G, T, da, dd) of one use with per-example input/output shapes, for the cost model."""
        raise NotImplementedError

    def factor_key(self, config: Any) -> Hashable:
        """Uses whose factors may be concatenated along T into one factored term have equal keys (the same
        meaning of A and D for the parameter's elements)."""
        return type(self).__name__

    def keeps_delta(self, config: Any) -> bool:
        """Whether ``factors`` returns D as a view of δ (a reshape), so what the capture declared about δ (its
        layout, being shared by all examples) holds for D too."""
        return False

    def index_rows(self, config: Any) -> int:
        """The rows of A's one-hot for id inputs (embedding), else 0."""
        return 0

    def jacobians(
        self,
        config: Any,
        roles: tuple[str, ...],
        a: torch.Tensor,
        delta: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        layout: Layout = Layout.EXAMPLE_MAJOR,
        thin: bool = True,
    ) -> dict[str, torch.Tensor]:
        """J of each role's tensor for one use, role -> (n, k, numel) in the op tensor's layout; a rule may share
        work between them (one pass over δ for a weight and its bias). ``layout``: δ's memory order, as its capture
        declared it. ``thin``: the rule's thin-operand form may be used (``StructuredOptions.thin_conv_jacobian``)."""
        return {role: self.jacobian(config, role, a, delta, state) for role in roles}

    def jacobian(
        self, config: Any, role: str, a: torch.Tensor, delta: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """J of role ``role`` for one use: (n, k, numel)."""
        if role in self.factored:
            return factors_jacobian(self.factors(config, a, delta), self.index_rows(config))
        raise NotImplementedError


# ---------------------------------------------------------------- linear, matmul, addmm


@dataclass(frozen=True)
class LinearConfig:
    """y = a Wᵀ + b over leading positions. ``in_out``: the op's weight is stored (in, out) (``a @ M``, GPT-2's
    Conv1D), so J is laid out (in, out); else (out, in) as ``linear``'s."""

    in_out: bool


def _absorbed(mp: ParamMap | None, shape: tuple[int, ...]) -> tuple[ParamMap | None, bool]:
    """A 2-D matrix map with its transposition folded into the layout: (map with index None, True) when the op's
    matrix is exactly the parameter transposed, else (the map, False)."""
    if mp is None or mp.index is None or len(shape) != 2 or mp.index.ndim != 2:
        return mp, False
    t = mp.index.t()
    if t.numel() == mp.numel and torch.equal(t.reshape(-1), torch.arange(t.numel())):
        return ParamMap(mp.name, mp.numel, mp.scale, None), True
    return mp, False


class LinearRule(Rule):
    """``linear(a, W, b)``, ``a @ M`` (matmul/mm) and ``addmm(b, a, M)`` with a parameter as the matrix (any
    leading positions of a share it) and/or as the bias."""

    families = ("linear", "matmul", "addmm")

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        if op.family == "linear":
            a_name, w_name, b_name, w_scale, b_scale, in_out = "input", "weight", "bias", 1.0, 1.0, False
        elif op.family == "matmul":
            a_name, w_name, b_name, w_scale, b_scale, in_out = "input", "other", None, 1.0, 1.0, True
        else:  # addmm: β·input + α·(mat1 @ mat2)
            a_name, w_name, b_name, in_out = "mat1", "mat2", "input", True
            w_scale, b_scale = bound.get("alpha", 1), bound.get("beta", 1)
            if not all(isinstance(s, int | float) and not isinstance(s, bool) for s in (w_scale, b_scale)):
                return None
        a, w = _activation(bound, a_name, tracked), _tensor(bound.get(w_name))
        if a is None or w is None or w.ndim != 2 or a.ndim < 1:
            return None
        params: dict[str, ParamMap] = {}
        w_map = tracked(w)
        if w_map is not None:
            absorbed, flipped = _absorbed(w_map, tuple(w.shape))
            in_out ^= flipped
            params["weight"] = (absorbed or w_map).scaled(float(w_scale))
        b = _tensor(bound.get(b_name)) if b_name is not None else None
        b_map = tracked(b) if b is not None else None
        if b_map is not None:
            out = w.shape[1] if op.family != "linear" else w.shape[0]
            if b is None or tuple(b.shape) != (out,):
                return None  # a bias of another shape (addmm broadcasting a matrix): no rule
            params["bias"] = b_map.scaled(float(b_scale))
        if not params:
            return None
        return Call(self, LinearConfig(in_out), a_name, params, {})

    def factors(self, config: LinearConfig, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        n, k = delta.shape[:2]
        a = a.reshape(n, 1, -1, a.shape[-1])
        return Factors(a, delta.reshape(n, k, 1, a.shape[2], delta.shape[-1]))

    def factor_dims(self, config: Any, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1, math.prod(in_shape[:-1]), in_shape[-1], out_shape[-1])

    def factor_key(self, config: LinearConfig) -> Hashable:
        return (type(self).__name__, config.in_out)

    def keeps_delta(self, config: Any) -> bool:
        return True

    def jacobian(
        self, config: LinearConfig, role: str, a: torch.Tensor, delta: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        if role == "bias":
            return _sum_positions(delta, -1)
        j = super().jacobian(config, role, a, delta, state)  # (n, k, out·in)
        if config.in_out:
            n, k = j.shape[:2]
            return j.view(n, k, delta.shape[-1], a.shape[-1]).transpose(2, 3).reshape(n, k, -1)
        return j


# ---------------------------------------------------------------- convolutions


THIN_PATCH = 64
"""Patch sizes q (C_in/G·kh·kw) below which ``ConvRule`` builds a weight's J transposed (see there)."""


@dataclass(frozen=True)
class ConvConfig:
    """A zero-padded convolution's geometry: ``spatial`` 1 or 2; kernel, stride, dilation per spatial dim;
    padding per spatial dim or "same"/"valid"."""

    spatial: int
    in_channels: int
    out_channels: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int

    def geometry(self) -> tuple[tuple[int, ...], ...]:
        """(kernel, stride, dilation) as 2-D tuples (Conv1d as a 1 x L image)."""
        if self.spatial == 1:
            return (1, *self.kernel), (1, *self.stride), (1, *self.dilation)
        return self.kernel, self.stride, self.dilation

    def pad(self) -> tuple[int, ...]:
        """(left, right, top, bottom) zero padding in F.pad order for the 2-D view of the input."""
        kernel, _, dilation = self.geometry()
        if isinstance(self.padding, str):
            if self.padding == "valid":
                return (0, 0, 0, 0)
            total = [d * (kk - 1) for d, kk in zip(dilation, kernel, strict=True)]  # 'same' (stride 1)
            return (total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2)
        pad = (0, *self.padding) if self.spatial == 1 else self.padding
        return (pad[1], pad[1], pad[0], pad[0])


def _per_dim(value: object, spatial: int) -> tuple[int, ...] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * spatial
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        items = tuple(int(v) for v in value)
        return items * spatial if len(items) == 1 else items if len(items) == spatial else None
    return None


class ConvRule(Rule):
    """conv1d/conv2d (and ``aten.convolution`` not transposed) with zero padding (ints, 'valid' or 'same'),
    stride, dilation, groups.

    Positions t are the output positions p (times any leading per-example dims); A[g, p] is the receptive-field
    patch of group g (``F.unfold``), D_c[g, p] the cotangent of group g's output channels at p.
    """

    families = ("conv", "convolution")

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        a, w = _activation(bound, "input", tracked), _tensor(bound.get("weight"))
        if a is None or w is None or w.ndim not in (3, 4) or a.ndim != w.ndim:
            return None  # an unbatched input, or conv3d
        if op.family == "convolution" and (bound.get("transposed") is not False):
            return None
        spatial = w.ndim - 2
        groups = bound.get("groups", 1)
        stride, dilation = _per_dim(bound.get("stride", 1), spatial), _per_dim(bound.get("dilation", 1), spatial)
        padding_arg = bound.get("padding", 0)
        padding = padding_arg if padding_arg in ("same", "valid") else _per_dim(padding_arg, spatial)
        if stride is None or dilation is None or padding is None or not isinstance(groups, int):
            return None
        if padding == "same" and any(s != 1 for s in stride):
            return None
        params = _affine_roles(bound, tracked)
        if not params:
            return None
        config = ConvConfig(
            spatial,
            int(w.shape[1]) * groups,
            int(w.shape[0]),
            tuple(int(s) for s in w.shape[2:]),
            stride,
            padding,
            dilation,
            groups,
        )
        return Call(self, config, "input", params, {})

    def _patches(self, config: ConvConfig, a: torch.Tensor, ones_row: bool = False) -> torch.Tensor:
        """Receptive-field patches of a (n, *B, C_in, *spatial): (n·B, C_in·kh·kw, L), and a last row of ones
        (n·B, C_in·kh·kw + 1, L) when ``ones_row``."""
        sp = config.spatial
        images = a.reshape(-1, config.in_channels, *a.shape[a.ndim - sp :])  # (n·B, C_in, *spatial)
        if sp == 1:
            images = images.unsqueeze(2)
        kernel, stride, dilation = config.geometry()
        padding = config.pad()
        if any(padding):
            images = F.pad(images, padding)
        # F.unfold as a strided view (b, C_in, kh, kw, H_out, W_out) of the images and one copy: ~4x faster
        # than im2col, and it reads channels-last images in place (NOTE [channels-last capture])
        b, c, h, w = images.shape
        out_h = (h - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
        out_w = (w - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
        sb, sc, sh, sw = images.stride()
        windows = images.as_strided(
            (b, c, kernel[0], kernel[1], out_h, out_w),
            (sb, sc, sh * dilation[0], sw * dilation[1], sh * stride[0], sw * stride[1]),
            images.storage_offset(),
        )
        q = c * kernel[0] * kernel[1]
        if not ones_row:
            return windows.reshape(b, q, out_h * out_w)
        patches = torch.empty((b, q + 1, out_h * out_w), dtype=a.dtype)
        patches[:, :q].view(windows.shape).copy_(windows)
        patches[:, q].fill_(1)
        return patches

    def factors(self, config: ConvConfig, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        n, k = delta.shape[:2]
        c_out, groups = config.out_channels, config.groups
        patches = self._patches(config, a)  # (n·B, C_in·kh·kw, L)
        length = patches.shape[-1]
        q = patches.shape[1] // groups
        a_f = patches.view(n, -1, groups, q, length).permute(0, 2, 1, 4, 3).reshape(n, groups, -1, q)
        d = delta.reshape(n, k, -1, groups, c_out // groups, length)  # (n, k, B, G, o, L)
        d_f = d.permute(0, 1, 3, 2, 5, 4).reshape(n, k, groups, -1, c_out // groups)
        return Factors(a_f, d_f)

    def factor_dims(self, config: ConvConfig, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        sp = config.spatial
        positions = math.prod(out_shape[: len(out_shape) - sp - 1]) * math.prod(out_shape[len(out_shape) - sp :])
        g = config.groups
        q = config.in_channels // g * math.prod(config.kernel)
        return (g, positions, q, config.out_channels // g)

    def factor_key(self, config: ConvConfig) -> Hashable:
        return (type(self).__name__, config.groups)

    def jacobians(
        self,
        config: ConvConfig,
        roles: tuple[str, ...],
        a: torch.Tensor,
        delta: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        layout: Layout = Layout.EXAMPLE_MAJOR,
        thin: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The weight's J and, with thin patches, the bias's J from the same matmul (a row of ones under the
        patches sums δ over positions: one read of the layer's largest δ instead of two); see ``jacobian``."""
        thin_j = None
        if "weight" in roles and thin:
            thin_j = self._thin_jacobians(config, a, delta, with_bias="bias" in roles)
        if thin_j is not None:
            return {role: thin_j[role] for role in roles}
        return {role: self._jacobian(config, role, a, delta, layout=layout, thin=thin) for role in roles}

    def jacobian(
        self, config: ConvConfig, role: str, a: torch.Tensor, delta: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        return self._jacobian(config, role, a, delta, layout=Layout.EXAMPLE_MAJOR, thin=True)

    def _jacobian(
        self, config: ConvConfig, role: str, a: torch.Tensor, delta: torch.Tensor, *, layout: Layout, thin: bool
    ) -> torch.Tensor:
        sp = config.spatial
        if role == "bias":
            return _sum_positions(delta, delta.ndim - sp - 1)
        n, k = delta.shape[:2]
        if config.groups > 1 or math.prod(delta.shape[2 : delta.ndim - sp - 1]) > 1:
            return factors_jacobian(self.factors(config, a, delta))
        thin_j = self._thin_jacobians(config, a, delta, with_bias=False) if thin else None
        if thin_j is not None:
            return thin_j["weight"]
        # one group, one image per example: J = δ (k·C_out, L) @ patchesᵀ (L, q) per example, one bmm; with δ
        # in (k, n, ...) memory (vmapped capture) one bmm per output c reads it in place instead
        d = delta.reshape(n, k, config.out_channels, -1)
        patches_t = self._patches(config, a).transpose(1, 2)  # (n, L, q)
        if layout is Layout.EXAMPLE_MAJOR:
            return torch.bmm(d.reshape(n, k * config.out_channels, -1), patches_t).view(n, k, -1)
        out = torch.empty(k, n, config.out_channels, patches_t.shape[-1], dtype=delta.dtype)
        for c in range(k):
            torch.bmm(d[:, c], patches_t, out=out[c])
        return out.transpose(0, 1).reshape(n, k, -1)

    def _thin_jacobians(
        self, config: ConvConfig, a: torch.Tensor, delta: torch.Tensor, *, with_bias: bool
    ) -> dict[str, torch.Tensor] | None:
        """J of the weight (and the bias) as Jᵀ = patches (q (+1), L) @ δ (L, k·C_out) per example, or None when
        that form does not apply. With δ in (n, L, k, C_out) memory (channels-last capture) and thin patches
        (q < THIN_PATCH) both operands are read row-major and one small copy transposes the result: BLAS is ~2x
        slower on a thin output from two transposed operands (``StructuredOptions.thin_conv_jacobian``)."""
        sp = config.spatial
        if config.groups > 1 or math.prod(delta.shape[2 : delta.ndim - sp - 1]) > 1:
            return None
        n, k = delta.shape[:2]
        c_out = config.out_channels
        by_position = delta.reshape(n, k, c_out, -1).permute(0, 3, 1, 2)  # (n, L, k, C_out)
        q = config.in_channels * math.prod(config.kernel)
        if q >= THIN_PATCH or not by_position[0].is_contiguous():
            return None
        patches = self._patches(config, a, ones_row=with_bias)  # (n, q (+1), L)
        j_t = torch.bmm(patches, by_position.reshape(n, -1, k * c_out))  # (n, q (+1), k·C_out)
        out = {"weight": j_t[:, :q].transpose(1, 2).reshape(n, k, -1)}
        if with_bias:
            out["bias"] = j_t[:, q].view(n, k, c_out)
        return out


# ---------------------------------------------------------------- embedding


@dataclass(frozen=True)
class EmbeddingConfig:
    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None


class EmbeddingRule(Rule):
    """Embedding lookup: J_c[v] = Σ_t δ_c[t] [id_t = v]; rows at ``padding_idx`` get no gradient."""

    families = ("embedding", "aten_embedding")

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        ids, w = _activation(bound, "input", tracked), _tensor(bound.get("weight"))
        mp = tracked(w) if w is not None else None
        if ids is None or w is None or mp is None or w.ndim != 2 or ids.is_floating_point():
            return None
        rows = int(w.shape[0])
        padding = bound.get("padding_idx")
        if op.family == "embedding":
            # max_norm renormalises the weight in place; scale_grad_by_freq rescales by batch counts: no rule
            if bound.get("max_norm") is not None or bound.get("scale_grad_by_freq", False):
                return None
            padding = None if padding is None else int(padding) + (rows if padding < 0 else 0)
        else:  # aten.embedding: -1 is "none" (F.embedding has made negative indices positive)
            if bound.get("scale_grad_by_freq", False):
                return None
            padding = None if padding is None or padding < 0 else int(padding)
        return Call(self, EmbeddingConfig(rows, int(w.shape[1]), padding), "input", {"weight": mp}, {})

    def factors(self, config: EmbeddingConfig, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        n, k = delta.shape[:2]
        ids = a.reshape(n, 1, -1)
        d = delta.reshape(n, k, 1, ids.shape[-1], delta.shape[-1])
        if config.padding_idx is not None:
            d = d * (ids != config.padding_idx).to(d.dtype)[:, None, :, :, None]
        return Factors(ids, d, index=True)

    def factor_dims(
        self, config: EmbeddingConfig, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        return (1, math.prod(in_shape), config.num_embeddings, config.embedding_dim)

    def index_rows(self, config: EmbeddingConfig) -> int:
        return config.num_embeddings

    def keeps_delta(self, config: EmbeddingConfig) -> bool:
        return config.padding_idx is None  # else D is δ masked at the padding ids: a new tensor


# ---------------------------------------------------------------- normalisations


@dataclass(frozen=True)
class NormConfig:
    """``kind`` "layer_norm", "rms_norm", "group_norm" or "batch_norm"; ``shape`` the normalized shape (layer and
    RMS norm) or (num_groups,) (group norm); ``eps`` (None: rms_norm's default of the dtype)."""

    kind: str
    shape: tuple[int, ...]
    eps: float | None


class NormRule(Rule):
    """Elementwise affine of a normalisation: y = x̂ ⊙ w + b, so J_w = Σ_t δ[t] ⊙ x̂[t], J_b = Σ_t δ[t].

    LayerNorm and RMSNorm normalise the trailing ``normalized_shape``; GroupNorm and eval-mode BatchNorm (running
    statistics) have one affine entry per channel, the op's dim 1 (the per-example logical dimension 1).
    """

    families = ("layer_norm", "rms_norm", "group_norm", "batch_norm")
    factored = ()

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        a = _activation(bound, "input", tracked)
        if a is None or a.ndim < 2:
            return None
        state: dict[str, torch.Tensor] = {}
        if op.family == "batch_norm":
            mean, var = _tensor(bound.get("running_mean")), _tensor(bound.get("running_var"))
            if bound.get("training", False) is not False or mean is None or var is None:
                return None  # batch statistics: examples interact (refused by prepare_problem)
            if tracked(mean) is not None or tracked(var) is not None:
                return None
            state = {"running_mean": mean, "running_var": var}
            shape: tuple[int, ...] = ()
        elif op.family == "group_norm":
            shape = (int(bound.get("num_groups", 1)),)
        else:
            shape = tuple(int(s) for s in bound.get("normalized_shape", ()))
        eps = bound.get("eps", None if op.family == "rms_norm" else 1e-5)
        params = _affine_roles(bound, tracked)
        if not params:
            return None
        return Call(self, NormConfig(op.family, shape, None if eps is None else float(eps)), "input", params, state)

    @staticmethod
    def _channel_last(config: NormConfig, t: torch.Tensor, lead: int) -> torch.Tensor:
        """t (*lead, *per-example) -> (*lead, positions, channels) with the affine axis last."""
        if config.kind in ("layer_norm", "rms_norm"):
            return t.reshape(*t.shape[:lead], -1, math.prod(config.shape))
        moved = t.movedim(lead + 1, -1)
        return moved.reshape(*t.shape[:lead], -1, moved.shape[-1])

    @staticmethod
    def _normalized(config: NormConfig, a: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        eps = config.eps
        if config.kind == "layer_norm":
            return F.layer_norm(a, config.shape, None, None, 1e-5 if eps is None else eps)
        if config.kind == "rms_norm":
            return F.rms_norm(a, config.shape, None, eps)
        if config.kind == "group_norm":
            flat = a.reshape(-1, *a.shape[2:])
            return F.group_norm(flat, config.shape[0], None, None, 1e-5 if eps is None else eps).view_as(a)
        shape = (1, 1, -1) + (1,) * (a.ndim - 3)
        mean, var = state["running_mean"].view(shape), state["running_var"].view(shape)
        return (a - mean) * torch.rsqrt(var + (1e-5 if eps is None else eps))

    def jacobian(
        self, config: NormConfig, role: str, a: torch.Tensor, delta: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        d = self._channel_last(config, delta, 2)  # (n, k, T, C)
        if role == "bias":
            return d.sum(2)
        x_hat = self._channel_last(config, self._normalized(config, a, state), 1)  # (n, T, C)
        return torch.einsum("nktc,ntc->nkc", d, x_hat)


# ---------------------------------------------------------------- elementwise


@dataclass(frozen=True)
class ElementwiseConfig:
    """y = u + c·p (``bias``: add, sub, a broadcast by expand) or y = u ⊙ p (``scale``); ``shape``: the shape of the
    op's operand p, broadcast against the per-example output."""

    scale: bool
    coefficient: float
    shape: tuple[int, ...]


class ElementwiseRule(Rule):
    """A parameter as an elementwise operand whose other operand is an activation: a bias (``x + b``, ``x - b``, a
    learned position embedding added, a class token expanded over the batch) or a scale (``x * g``: a gate, a
    LayerScale). J_p = Σ δ ⊙ (u for a scale, c for a bias) over the dims p is broadcast along."""

    families = ("add", "sub", "rsub", "mul", "expand", "expand_as")
    factored = ()

    def parse(self, op: Op, bound: Mapping[str, Any], tracked: Tracked) -> Call | None:
        if op.family in ("expand", "expand_as"):
            p = _tensor(bound.get("input"))
            mp = tracked(p) if p is not None else None
            if p is None or mp is None:
                return None
            return Call(self, ElementwiseConfig(False, 1.0, tuple(p.shape)), None, {"operand": mp}, {})
        left, right = _tensor(bound.get("input")), _tensor(bound.get("other"))
        if left is None or right is None:
            return None  # a number operand: a derivation, not a use
        maps = (tracked(left), tracked(right))
        if (maps[0] is None) == (maps[1] is None):
            return None  # no parameter, or one on both sides (a product of parameters): no rule
        alpha = bound.get("alpha", 1)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            return None
        side = 0 if maps[0] is not None else 1
        p, mp = (left, right)[side], maps[side]
        assert mp is not None
        if op.family == "mul":
            return Call(
                self, ElementwiseConfig(True, 1.0, tuple(p.shape)), ("other", "input")[side], {"operand": mp}, {}
            )
        # add: u + α·v; sub: u − α·v; rsub: v − α·u (u = input, v = other)
        coefficient = {
            ("add", 0): 1.0,
            ("add", 1): float(alpha),
            ("sub", 0): 1.0,
            ("sub", 1): -float(alpha),
            ("rsub", 0): -float(alpha),
            ("rsub", 1): 1.0,
        }[op.family, side]
        return Call(self, ElementwiseConfig(False, coefficient, tuple(p.shape)), None, {"operand": mp}, {})

    def jacobian(
        self,
        config: ElementwiseConfig,
        role: str,
        a: torch.Tensor,
        delta: torch.Tensor,
        state: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        n, k = delta.shape[:2]
        out = delta.shape[2:]
        if config.scale:
            u = a.reshape(n, 1, *(1,) * (len(out) - (a.ndim - 1)), *a.shape[1:])
            g = delta * u
        else:
            g = delta * config.coefficient if config.coefficient != 1.0 else delta
        shape = (1,) * (len(out) - len(config.shape)) + config.shape  # p right-aligned with the output
        dims = tuple(2 + i for i, (s, o) in enumerate(zip(shape, out, strict=True)) if s == 1 and o != 1)
        if dims:
            g = g.sum(dims, keepdim=True)
        return g.reshape(n, k, math.prod(config.shape))


RULES: tuple[Rule, ...] = (LinearRule(), ConvRule(), EmbeddingRule(), NormRule(), ElementwiseRule())
"""Every rule; an op family has at most one."""

_BY_FAMILY: dict[str, Rule] = {family: rule for rule in RULES for family in rule.families}


def rule_for(op: Op) -> Rule | None:
    """The rule of an op's family, or None (its parameters fall back to the Jacobian path)."""
    return _BY_FAMILY.get(op.family)
