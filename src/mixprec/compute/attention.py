"""Scaled dot-product attention from bf16 GEMMs, for CPUs where PyTorch's bf16 attention is slow.

PyTorch's CPU flash-attention kernel runs no faster in bf16 than in FP32 (about 23 ms per layer of a
6-head, 256-token, batch-8 GPT on the 2-core development machine) and becomes a quarter of a bf16
training step. The same attention as batched bf16 GEMMs (FP32 accumulation) with a fused softmax
takes about 18 ms, and the backward pass recomputes the probabilities from the saved q, k and v, so it
keeps no (L x S) tensor for backward: saved activations stay what the flash kernel keeps.

Numerics: the logits q @ k^T come out of the GEMM rounded to bf16 (as in Megatron's fused-softmax path
and PyTorch's own math path); the softmax is computed in FP32 and its probabilities rounded to bf16 for
the second GEMM. A power-of-two scale (head dims 4, 16, 64, 256) is folded into q exactly; another
scale multiplies the bf16 logits. The flash kernel keeps FP32 logits: the gradient error against an
FP64 reference is about 1.6x the flash kernel's (measured in tests/unit/test_attention.py).

The region (:mod:`mixprec.regions.autocast`) uses it for bf16 inputs on CPUs under native bf16
compute where the kernel probe measured it faster, with autograd on (the probe timed training),
unless the policy lists ``scaled_dot_product_attention`` among its FP32 ops; dropout, grouped-query
attention and a float mask that needs a gradient fall back to PyTorch's kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixprec.compute.eager_frames import run_eagerly_when_called_back

__all__ = ["GemmAttention", "gemm_attention"]


@functools.lru_cache(maxsize=8)
def _causal_bias(length: int, source: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask as an additive bias, top-left aligned as torch's (query i sees keys 0..i).
    Built once per shape rather than in every layer at every step; read only (never modified in place)."""
    with torch.inference_mode(False):  # built under inference mode it could never be saved for a backward
        keep = torch.ones(length, source, dtype=torch.bool, device=device).tril_()
        return torch.zeros(length, source, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))


def _mask_bias(attn_mask: torch.Tensor | None, is_causal: bool, length: int, source: int, like: torch.Tensor):
    """The additive bf16 mask (-inf where a query may not look), or None."""
    if is_causal:
        return _causal_bias(length, source, like.device, like.dtype)
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        zeros = torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device)
        return zeros.masked_fill_(~attn_mask, float("-inf"))
    return attn_mask.to(like.dtype)


def _probabilities(q_scaled, k, bias, post_scale):
    logits = torch.matmul(q_scaled, k.transpose(-2, -1))
    if post_scale != 1.0:
        logits.mul_(post_scale)
    if bias is None:
        return torch.softmax(logits, -1)  # FP32 inside, bf16 out
    in_place = torch.broadcast_shapes(logits.shape, bias.shape) == logits.shape
    logits = logits.add_(bias) if in_place else logits + bias
    # a query the mask lets see no key (a padded position): torch's kernels give it 0, a softmax of -inf only NaN,
    # which the loss and every gradient would take up even where the row is then multiplied by 0
    dead = torch.isneginf(logits).all(-1, keepdim=True)
    return torch.softmax(logits, -1).masked_fill_(dead, 0.0)


def _split_scale(scale: float) -> tuple[float, float]:
    """(pre, post): a power-of-two scale is folded into q exactly; any other multiplies the bf16 logits."""
    return (scale, 1.0) if math.frexp(scale)[0] == 0.5 else (1.0, scale)


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    """Inside the kernels: no torch function modes (this one included) and no autocast."""
    with torch._C.DisableTorchFunction(), torch.autocast("cpu", enabled=False):
        yield


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, bias, scale: float):
        pre, post = _split_scale(scale)
        with _plain():
            q_scaled = q * pre if pre != 1.0 else q
            out = torch.matmul(_probabilities(q_scaled, k, bias, post), v)
        ctx.save_for_backward(q, k, v, bias)
        ctx.pre, ctx.post = pre, post
        return out

    @staticmethod
    def backward(ctx: Any, grad_out):
        q, k, v, bias = ctx.saved_tensors
        with _plain():
            grad_out = grad_out.to(q.dtype)
            q_scaled = q * ctx.pre if ctx.pre != 1.0 else q
            probs = _probabilities(q_scaled, k, bias, ctx.post)
            grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
            grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
            grad_logits = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            scale = ctx.pre * ctx.post
            grad_q = torch.matmul(grad_logits, k).mul_(scale)
            grad_k = torch.matmul(grad_logits.transpose(-2, -1), q_scaled)
            if ctx.post != 1.0:
                grad_k.mul_(ctx.post)
        return grad_q, grad_k, grad_v, None, None


def gemm_attention(q, k, v, attn_mask=None, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale)`` from bf16 GEMMs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    bias = _mask_bias(attn_mask, is_causal, q.shape[-2], k.shape[-2], q)
    return _Attention.apply(q, k, v, bias, scale)


def _eligible(args: tuple, kwargs: dict) -> tuple | None:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask = bound.get("attn_mask")
    if set(bound) - set(names) or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if bound.get("dropout_p", 0.0) or bound.get("enable_gqa", False):
        return None
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() >= 2 for t in (q, k, v)):
        return None
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        return None  # broadcasting and grouped heads: PyTorch's kernel
    if mask is not None and (bound.get("is_causal", False) or not isinstance(mask, torch.Tensor) or mask.requires_grad):
        return None
    return q, k, v, mask, bool(bound.get("is_causal", False)), bound.get("scale")


class GemmAttention(TorchFunctionMode):
    """Route eligible ``F.scaled_dot_product_attention`` calls to :func:`gemm_attention`; ``refuse`` is called
    first with what this part does (the region passes its foreign-recompute refusal)."""

    def __init__(self, refuse: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._refuse = refuse
        self.attention_calls = 0  # the attention calls seen: a region whose forward makes none stops watching

    @run_eagerly_when_called_back
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Compiled, the compiler picks its own attention kernel (the probe timed eager kernels).
        if func is F.scaled_dot_product_attention and not torch.compiler.is_compiling():
            self.attention_calls += 1
            call = _eligible(args, kwargs)
            if call is not None:
                if self._refuse is not None:
                    self._refuse("bf16 GEMM attention")
                return gemm_attention(*call)
        return func(*args, **kwargs)
