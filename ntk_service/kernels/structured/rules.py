"""Structure rules of the structured-derivative NTK: how a layer's parameter Jacobian is built from the layer's
input a and the cotangents δ of the k outputs at the layer's output, without differentiating w.r.t. the parameter.

Every rule sees one *use* of its layer (one call) for a block of n examples: ``a`` (n, *input of the call, per
example) and ``delta`` (n, k, *output of the call, per example). A weight whose Jacobian is a sum of outer
products over positions t (and is block diagonal over groups g) returns ``Factors``:

    J_c = Σ_g Σ_t D_c[g, t] ⊗ A[g, t],      so   J1_c · J2_d = Σ_g Σ_{t,s} (D1_c[g,t] · D2_d[g,s]) (A1[g,t] · A2[g,s]),

which ``contraction.py`` contracts without ever forming J (the factored form) or turns into J with one batched
matmul (``factors_jacobian``), whichever its cost model says is cheaper. Parameters without factors (biases,
affine parameters of normalisation layers) give J directly, as they are cheap: J_b = Σ_t δ[t], J_w = Σ_t δ[t] ⊙ x̂[t].

=================== ===================================== ==============================================
layer               A[g, t] (da)                           D_c[g, t] (dd)
=================== ===================================== ==============================================
Linear (any lead)   a[t] (in), t over leading positions    δ_c[t] (out)
Conv1d / Conv2d     patch[p] of group g (C_in/G·kh·kw)     δ_c[g, p] (C_out/G), p over output positions
Embedding           one-hot(id[t]) (kept as ids)           δ_c[t] (embedding_dim), 0 at padding_idx
=================== ===================================== ==============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ntk_service.kernels.structured.descriptors import Layout

__all__ = ["RULES", "Factors", "Rule", "factors_jacobian", "rule_for"]


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
    """J from its factors, one batched matmul: (n, k, G·dd·da) in the parameter's memory layout.

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


class Rule:
    """One layer type. ``roles`` are the parameter attributes the rule covers; ``factored`` those with Factors."""

    types: tuple[type[nn.Module], ...] = ()
    stock_forward: tuple[object, ...] = ()
    factored: tuple[str, ...] = ("weight",)

    def matches(self, module: nn.Module) -> bool:
        """The module is one of ``types`` with the stock forward (a subclass overriding it, or a ``forward`` set on
        the instance as accelerate's hooks do, has other math)."""
        stock = type(module).forward in self.stock_forward and "forward" not in vars(module)
        return isinstance(module, self.types) and stock

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        """Attribute names of the module's parameters this rule covers (present and not None)."""
        return tuple(r for r in ("weight", "bias") if module._parameters.get(r) is not None)

    def factors(self, module: nn.Module, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        """Factors of the weight's Jacobian for one use: a (n, *in), delta (n, k, *out)."""
        raise NotImplementedError

    def factor_dims(self, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        """(G, T, da, dd) of one use with per-example input/output shapes, for the cost model."""
        raise NotImplementedError

    def keeps_delta(self, module: nn.Module) -> bool:
        """Whether ``factors`` returns D as a view of δ (a reshape), so what the capture declared about δ (its
        layout, being shared by all examples) holds for D too."""
        return False

    def jacobians(
        self,
        module: nn.Module,
        roles: tuple[str, ...],
        a: torch.Tensor,
        delta: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        layout: Layout = Layout.EXAMPLE_MAJOR,
        thin: bool = True,
    ) -> dict[str, torch.Tensor]:
        """J of each parameter in ``roles`` for one use, role -> (n, k, numel); a rule may share work between
        them (one pass over δ for a weight and its bias). ``layout``: δ's memory order, as its capture declared it.
        ``thin``: the rule's thin-operand form may be used (``StructuredOptions.thin_conv_jacobian``)."""
        return {role: self.jacobian(module, role, a, delta, state) for role in roles}

    def jacobian(
        self, module: nn.Module, role: str, a: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """J of parameter ``role`` for one use: (n, k, numel). ``state``: the module's tensors by attribute."""
        if role == "weight" and role in self.factored:
            return factors_jacobian(self.factors(module, a, delta), self.index_rows(module))
        raise NotImplementedError

    def index_rows(self, module: nn.Module) -> int:
        return 0


class LinearRule(Rule):
    """y = a Wᵀ + b over any leading dimensions (positions t share the weight)."""

    types = (nn.Linear,)
    stock_forward = (nn.Linear.forward,)

    def factors(self, module: nn.Module, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        n, k = delta.shape[:2]
        a = a.reshape(n, 1, -1, a.shape[-1])
        return Factors(a, delta.reshape(n, k, 1, a.shape[2], delta.shape[-1]))

    def factor_dims(self, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1, math.prod(in_shape[:-1]), in_shape[-1], out_shape[-1])

    def keeps_delta(self, module: nn.Module) -> bool:
        return True

    def jacobian(
        self, module: nn.Module, role: str, a: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if role == "bias":
            return _sum_positions(delta, -1)
        return super().jacobian(module, role, a, delta, state)


THIN_PATCH = 64
"""Patch sizes q (C_in/G·kh·kw) below which ``ConvRule`` builds a weight's J transposed (see there)."""


def _conv_geometry(module: nn.Conv1d | nn.Conv2d) -> tuple[tuple[int, ...], ...]:
    """(kernel, stride, dilation) as 2-D tuples (Conv1d as a 1 x L image)."""
    if isinstance(module, nn.Conv1d):
        return (1, *module.kernel_size), (1, *module.stride), (1, *module.dilation)
    return tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation)


def _conv_padding(module: nn.Conv1d | nn.Conv2d) -> tuple[int, ...]:
    """(left, right, top, bottom) zero padding in F.pad order for the 2-D view of the input."""
    kernel, _, dilation = _conv_geometry(module)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0, 0, 0)
        total = [d * (kk - 1) for d, kk in zip(dilation, kernel, strict=True)]  # 'same' (stride 1)
        return (total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2)
    pad = (0, *module.padding) if isinstance(module, nn.Conv1d) else tuple(module.padding)
    return (pad[1], pad[1], pad[0], pad[0])


class ConvRule(Rule):
    """Conv1d/Conv2d with zero padding (ints, 'valid' or 'same'), stride, dilation, groups.

    Positions t are the output positions p (times any leading per-example dims); A[g, p] is the receptive-field
    patch of group g (``F.unfold``), D_c[g, p] the cotangent of group g's output channels at p.
    """

    types = (nn.Conv1d, nn.Conv2d)
    stock_forward = (nn.Conv1d.forward, nn.Conv2d.forward)

    def matches(self, module: nn.Module) -> bool:
        return super().matches(module) and module.padding_mode == "zeros"

    @staticmethod
    def _spatial(module: nn.Module) -> int:
        return 1 if isinstance(module, nn.Conv1d) else 2

    def _patches(self, module: nn.Module, a: torch.Tensor, ones_row: bool = False) -> torch.Tensor:
        """Receptive-field patches of a (n, *B, C_in, *spatial): (n·B, C_in·kh·kw, L), and a last row of ones
        (n·B, C_in·kh·kw + 1, L) when ``ones_row``."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        sp = self._spatial(module)
        images = a.reshape(-1, module.in_channels, *a.shape[a.ndim - sp :])  # (n·B, C_in, *spatial)
        if sp == 1:
            images = images.unsqueeze(2)
        kernel, stride, dilation = _conv_geometry(module)
        padding = _conv_padding(module)
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

    def factors(self, module: nn.Module, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        n, k = delta.shape[:2]
        c_out, groups = module.out_channels, module.groups
        patches = self._patches(module, a)  # (n·B, C_in·kh·kw, L)
        length = patches.shape[-1]
        q = patches.shape[1] // groups
        a_f = patches.view(n, -1, groups, q, length).permute(0, 2, 1, 4, 3).reshape(n, groups, -1, q)
        d = delta.reshape(n, k, -1, groups, c_out // groups, length)  # (n, k, B, G, o, L)
        d_f = d.permute(0, 1, 3, 2, 5, 4).reshape(n, k, groups, -1, c_out // groups)
        return Factors(a_f, d_f)

    def factor_dims(self, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        sp = self._spatial(module)
        positions = math.prod(out_shape[: len(out_shape) - sp - 1]) * math.prod(out_shape[len(out_shape) - sp :])
        g = module.groups
        q = module.in_channels // g * math.prod(module.kernel_size)
        return (g, positions, q, module.out_channels // g)

    def jacobians(
        self,
        module: nn.Module,
        roles: tuple[str, ...],
        a: torch.Tensor,
        delta: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        layout: Layout = Layout.EXAMPLE_MAJOR,
        thin: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The weight's J and, with thin patches, the bias's J from the same matmul (a row of ones under the
        patches sums δ over positions: one read of the layer's largest δ instead of two); see ``jacobian``."""
        thin_j = None
        if "weight" in roles and thin:
            thin_j = self._thin_jacobians(module, a, delta, with_bias="bias" in roles)
        if thin_j is not None:
            return {role: thin_j[role] for role in roles}
        return {role: self._jacobian(module, role, a, delta, state, layout=layout, thin=thin) for role in roles}

    def jacobian(
        self, module: nn.Module, role: str, a: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self._jacobian(module, role, a, delta, state, layout=Layout.EXAMPLE_MAJOR, thin=True)

    def _jacobian(
        self,
        module: nn.Module,
        role: str,
        a: torch.Tensor,
        delta: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        layout: Layout,
        thin: bool,
    ) -> torch.Tensor:
        sp = self._spatial(module)
        if role == "bias":
            return _sum_positions(delta, delta.ndim - sp - 1)
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        n, k = delta.shape[:2]
        if module.groups > 1 or math.prod(delta.shape[2 : delta.ndim - sp - 1]) > 1:
            return super().jacobian(module, role, a, delta, state)
        thin_j = self._thin_jacobians(module, a, delta, with_bias=False) if thin else None
        if thin_j is not None:
            return thin_j["weight"]
        # one group, one image per example: J = δ (k·C_out, L) @ patchesᵀ (L, q) per example, one bmm; with δ
        # in (k, n, ...) memory (vmapped capture) one bmm per output c reads it in place instead
        d = delta.reshape(n, k, module.out_channels, -1)
        patches_t = self._patches(module, a).transpose(1, 2)  # (n, L, q)
        if layout is Layout.EXAMPLE_MAJOR:
            return torch.bmm(d.reshape(n, k * module.out_channels, -1), patches_t).view(n, k, -1)
        out = torch.empty(k, n, module.out_channels, patches_t.shape[-1], dtype=delta.dtype)
        for c in range(k):
            torch.bmm(d[:, c], patches_t, out=out[c])
        return out.transpose(0, 1).reshape(n, k, -1)

    def _thin_jacobians(
        self, module: nn.Module, a: torch.Tensor, delta: torch.Tensor, *, with_bias: bool
    ) -> dict[str, torch.Tensor] | None:
        """J of the weight (and the bias) as Jᵀ = patches (q (+1), L) @ δ (L, k·C_out) per example, or None when
        that form does not apply. With δ in (n, L, k, C_out) memory (channels-last capture) and thin patches
        (q < THIN_PATCH) both operands are read row-major and one small copy transposes the result: BLAS is ~2x
        slower on a thin output from two transposed operands (``StructuredOptions.thin_conv_jacobian``)."""
        assert isinstance(module, nn.Conv1d | nn.Conv2d)
        sp = self._spatial(module)
        if module.groups > 1 or math.prod(delta.shape[2 : delta.ndim - sp - 1]) > 1:
            return None
        n, k = delta.shape[:2]
        c_out = module.out_channels
        by_position = delta.reshape(n, k, c_out, -1).permute(0, 3, 1, 2)  # (n, L, k, C_out)
        q = module.in_channels * math.prod(module.kernel_size)
        if q >= THIN_PATCH or not by_position[0].is_contiguous():
            return None
        patches = self._patches(module, a, ones_row=with_bias)  # (n, q (+1), L)
        j_t = torch.bmm(patches, by_position.reshape(n, -1, k * c_out))  # (n, q (+1), k·C_out)
        out = {"weight": j_t[:, :q].transpose(1, 2).reshape(n, k, -1)}
        if with_bias:
            out["bias"] = j_t[:, q].view(n, k, c_out)
        return out


class EmbeddingRule(Rule):
    """Embedding lookup: J_c[v] = Σ_t δ_c[t] [id_t = v]; rows at ``padding_idx`` get no gradient."""

    types = (nn.Embedding,)
    stock_forward = (nn.Embedding.forward,)

    def matches(self, module: nn.Module) -> bool:
        # max_norm renormalises the weight in place; scale_grad_by_freq rescales by batch counts: no rule for those.
        return super().matches(module) and module.max_norm is None and not module.scale_grad_by_freq

    def factors(self, module: nn.Module, a: torch.Tensor, delta: torch.Tensor) -> Factors:
        assert isinstance(module, nn.Embedding)
        n, k = delta.shape[:2]
        ids = a.reshape(n, 1, -1)
        d = delta.reshape(n, k, 1, ids.shape[-1], delta.shape[-1])
        if module.padding_idx is not None:
            d = d * (ids != module.padding_idx).to(d.dtype)[:, None, :, :, None]
        return Factors(ids, d, index=True)

    def factor_dims(self, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
        assert isinstance(module, nn.Embedding)
        return (1, math.prod(in_shape), module.num_embeddings, module.embedding_dim)

    def index_rows(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Embedding)
        return module.num_embeddings

    def keeps_delta(self, module: nn.Module) -> bool:
        assert isinstance(module, nn.Embedding)
        return module.padding_idx is None  # else D is δ masked at the padding ids: a new tensor


class NormRule(Rule):
    """Elementwise affine of a normalisation: y = x̂ ⊙ w + b, so J_w = Σ_t δ[t] ⊙ x̂[t], J_b = Σ_t δ[t].

    LayerNorm and RMSNorm normalise the trailing ``normalized_shape``; GroupNorm and eval-mode BatchNorm (running
    statistics) have one affine entry per channel, the per-example logical dimension 1.
    """

    types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    stock_forward = (
        nn.LayerNorm.forward,
        nn.RMSNorm.forward,
        nn.GroupNorm.forward,
        nn.modules.batchnorm._BatchNorm.forward,
    )
    factored = ()

    def matches(self, module: nn.Module) -> bool:
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None:
            return False  # batch statistics even in eval: examples interact (refused by prepare_problem)
        return super().matches(module)

    @staticmethod
    def _channel_last(module: nn.Module, t: torch.Tensor, lead: int) -> torch.Tensor:
        """t (*lead, *per-example) -> (*lead, positions, channels) with the affine axis last."""
        if isinstance(module, nn.LayerNorm | nn.RMSNorm):
            width = math.prod(module.normalized_shape)
            return t.reshape(*t.shape[:lead], -1, width)
        moved = t.movedim(lead + 1, -1)
        return moved.reshape(*t.shape[:lead], -1, moved.shape[-1])

    def _normalized(self, module: nn.Module, a: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        if isinstance(module, nn.RMSNorm):
            return F.rms_norm(a, module.normalized_shape, None, module.eps)
        if isinstance(module, nn.GroupNorm):
            flat = a.reshape(-1, *a.shape[2:])
            return F.group_norm(flat, module.num_groups, None, None, module.eps).view_as(a)
        assert isinstance(module, nn.modules.batchnorm._BatchNorm)
        shape = (1, 1, -1) + (1,) * (a.ndim - 3)
        mean, var = state["running_mean"].view(shape), state["running_var"].view(shape)
        return (a - mean) * torch.rsqrt(var + module.eps)

    def jacobian(
        self, module: nn.Module, role: str, a: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        d = self._channel_last(module, delta, 2)  # (n, k, T, C)
        if role == "bias":
            return d.sum(2)
        x_hat = self._channel_last(module, self._normalized(module, a, state), 1)  # (n, T, C)
        return torch.einsum("nktc,ntc->nkc", d, x_hat)


RULES: tuple[Rule, ...] = (LinearRule(), ConvRule(), EmbeddingRule(), NormRule())
"""Every rule, tried in order; the first that matches a module covers it."""


def rule_for(module: nn.Module) -> Rule | None:
    """The rule covering ``module``, or None (its parameters fall back to the Jacobian path)."""
    return next((rule for rule in RULES if rule.matches(module)), None)
