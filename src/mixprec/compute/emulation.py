"""16-bit autocast emulated in FP32, for devices without 16-bit arithmetic (fp16 on most CPUs).

PyTorch runs fp16 matmuls and convolutions on such CPUs in slow reference kernels (6x to 36x slower
than FP32). ``EmulatedAutocast`` gives the same numerics as a GPU's tensor cores at FP32 speed:

    autocast's lower-precision ops (linear, matmul, conv, bmm, addmm, attention, ...):
        inputs rounded to the 16-bit format, product accumulated in FP32, output returned as a
        16-bit tensor
    autocast's FP32 ops (softmax, log_softmax, norms, losses, exp/log, reductions):
        computed in FP32 on FP32 inputs, as CUDA autocast does
    batch_norm: computed in FP32, output in the input's dtype (what cuDNN does with fp16 inputs)
    everything else: runs in whatever dtype its inputs have (16-bit activations stay 16-bit)

Because rounding happens through ordinary dtype casts, autograd rounds the gradients the same way:
the gradient flowing into a 16-bit activation, and the gradients of a GEMM's inputs, are 16-bit
tensors, so small gradients underflow and large ones overflow exactly as on a GPU, and loss scaling
matters exactly as much. Products of two fp16 values are exact in FP32, so a GEMM differs from a
tensor core's only in the order of its FP32 additions. Elementwise ops between GEMMs run in fp16
storage on the CPU's own fp16 kernels.

Weights cast to the 16-bit format are cached for the region, as torch.autocast caches them.

Memory: the FP32 copies that a GEMM computes with hold 16-bit values, so when autograd saves them for
the backward pass a saved-tensor hook stores them as the 16-bit tensors they came from (exact) and
widens them again when the backward pass needs them. Attention's backward also keeps its own output,
computed here in FP32: it is kept as the 16-bit output the op returns, as a GPU's flash attention keeps
it, so its gradients are computed from that rounding (exactly what the GPU computes from). Saved
activations cost what they cost under a real 16-bit autocast.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from mixprec.compute.eager_frames import run_eagerly_when_called_back
from mixprec.compute.foreign_recompute import checkpoint_holds_saved
from mixprec.compute.nest import map_floating

__all__ = ["FP32_OPS", "LOWER_PRECISION_OPS", "EmulatedAutocast", "active_emulation"]


class _EnteredOnThread(threading.local):
    """The emulations entered on each thread, innermost last: per thread, as torch's mode stack is, so that an FP32
    module on one thread does not suspend (and a recompute does not find) another thread's emulation."""

    def __init__(self) -> None:
        self.emulations: list[EmulatedAutocast] = []


_ACTIVE = _EnteredOnThread()
_PACKED = "mixprec-16bit"

# CUDA autocast's op lists (torch 2.x), by the names the ops have at the Python level. The GEMM ops by kernel
# family: the kernel plan (compute/kernels.py) times each family and emulates it or not as a whole.
FAMILY_OPS: dict[str, frozenset[str]] = {
    "matmul": frozenset(
        {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "mv", "bmm", "addmm", "addmv", "addr", "baddbmm"}
        | {"addbmm", "chain_matmul", "multi_dot", "prelu"}
        # composites that autocast sees as the GEMMs they decompose into (bmm, mm) in C++, where no torch
        # function mode sees them: rounded as one GEMM (their products summed in FP32, rounded once)
        | {"einsum", "tensordot"}
    ),
    "conv": frozenset(
        {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
    ),
    "attention": frozenset({"scaled_dot_product_attention"}),
}
LOWER_PRECISION_OPS = frozenset().union(
    *FAMILY_OPS.values(),
    # recurrent layers (_VF's whole-sequence ops and torch's cells; CUDA autocast's _cudnn_rnn and cells):
    # left out, an RNN after a 16-bit layer took 16-bit input with FP32 weights, which torch refuses
    {"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"},
)
FP32_OPS = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "__rpow__",  # a number to a tensor's power: pow's Scalar overload, on CUDA's FP32 list as the other two
        "softplus",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "cross_entropy",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "prod",
        "sum",
        "linalg_vector_norm",  # with softmax and sum on CUDA's list that computes in FP32 unless a dtype is asked
        "linalg_matrix_norm",
    }
)
_SAME_DTYPE_FP32_OPS = frozenset({"batch_norm", "instance_norm"})
# Ops whose backward keeps their own output (flash attention: rowsum(dO * O)). On a GPU that is the 16-bit
# output the op returns; here the FP32 result before its rounding, kept instead as that rounding.
_SAVES_OWN_OUTPUT = frozenset({"scaled_dot_product_attention"})


class _Held:
    """A saved FP32 tensor that may prove to be the op's own output, then kept as its 16-bit rounding."""

    __slots__ = ("layout", "low", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.low: torch.Tensor | None = None

    def keep_low(self, low: torch.Tensor) -> None:
        tensor = self.tensor
        self.layout = (tensor.size(), tensor.stride(), tensor.storage_offset())
        self.low, self.tensor = low, None  # the FP32 output is freed with the op's last reference to it

    def stored(self) -> torch.Tensor:
        return self.low if self.low is not None else self.tensor

    def value(self) -> torch.Tensor:
        if self.low is None:
            return self.tensor
        return self.low.float().as_strided(*self.layout)  # the FP32 output's layout (casts preserve strides)


class EmulatedAutocast(TorchFunctionMode):
    """Autocast to ``dtype`` (fp16 or bf16) computed in FP32 with the 16-bit format's rounding."""

    def __init__(
        self,
        dtype: torch.dtype,
        fp32_ops: tuple[str, ...] = (),
        *,
        only: frozenset[str] | None = None,
        device_type: str = "cpu",
        saves_low: bool = True,
        refuse: Callable[[str], None] | None = None,
    ) -> None:
        """``only``: emulate just these ops, inside a ``torch.autocast(device_type)`` region that runs
        the rest natively (a hybrid plan, see :mod:`mixprec.compute.kernels`); the policy's FP32 ops
        are then left to :class:`~mixprec.regions.op_overrides.FP32Ops`. None: emulate the whole region.
        ``saves_low``: keep what autograd saves as 16-bit sources (saved-tensor hooks); off where another
        hook keeps them (an activation checkpoint's recompute). ``refuse``: called with what this part does,
        before each op it rounds, while it saves for backward (the region passes its foreign-recompute refusal)."""
        super().__init__()
        self.dtype = dtype
        self._user_fp32 = frozenset(n for op in fp32_ops for n in (op, f"__{op}__", f"__r{op}__"))
        self._only = None if only is None else frozenset(only) - self._user_fp32
        self._device_type = device_type
        self._weights: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # id -> (version, source, rounded)
        # storage of an FP32 copy -> (the copy, its 16-bit source); layouts match (both preserve strides)
        self._low_of: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._held: list[_Held] | None = None  # while an op of _SAVES_OWN_OUTPUT runs: its FP32 saved tensors
        self._suspended = 0
        self._saves_low = saves_low
        self._refuse = refuse

    def __enter__(self) -> EmulatedAutocast:
        super().__enter__()
        # Saving 16-bit sources for backward is an eager-mode saving; compiled, the compiler plans it. Inside a
        # checkpointed block (an emulation entered in its forward and again in its recompute: a bf16 module of an
        # fp16 region, a region inside the block) the checkpoint keeps nothing to save: its hooks must see every
        # saved tensor, else the forward and the recompute save different lists (CheckpointError).
        self._saving = self._saves_low and not torch.compiler.is_compiling() and not checkpoint_holds_saved()
        if self._saving:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self._saved_hooks.__enter__()
        _ACTIVE.emulations.append(self)
        return self

    @run_eagerly_when_called_back
    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved for backward: an FP32 copy of 16-bit values (or a view of one) is kept as its 16-bit source."""
        entry = self._low_of.get(tensor.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None:
            if self._held is not None and tensor.dtype == torch.float32:
                held = _Held(tensor)
                self._held.append(held)
                return held
            return tensor
        return (_PACKED, entry[1], tensor.size(), tensor.stride(), tensor.storage_offset())

    @run_eagerly_when_called_back
    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and packed[0] == _PACKED:
            _, low, size, stride, offset = packed
            return low.float().as_strided(size, stride, offset)  # the same layout as the FP32 copy it replaces
        if isinstance(packed, _Held):
            return packed.value()
        return packed

    @staticmethod
    def stored(packed: Any) -> torch.Tensor:
        """The tensor that :meth:`pack`'s result keeps in memory."""
        if isinstance(packed, tuple) and packed[0] == _PACKED:
            return packed[1]
        return packed.stored() if isinstance(packed, _Held) else packed

    def __exit__(self, *exc: Any) -> Any:
        _ACTIVE.emulations.remove(self)
        if self._saving:
            self._saved_hooks.__exit__(*exc)
        self._weights.clear()  # like autocast's cast cache: valid for one region
        self._low_of.clear()
        return super().__exit__(*exc)

    @run_eagerly_when_called_back
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("out") is not None:
            # Writes into a tensor the caller owns: rounding would redirect it to a copy. Compiled code
            # (inductor's extern kernels, which run while the mode is active) calls matmuls this way.
            return func(*args, **kwargs)
        name = getattr(func, "__name__", None)
        if self._only is not None:
            if self._suspended or name not in self._only:
                return func(*args, **kwargs)  # torch.autocast's native kernels
            with torch.autocast(self._device_type, enabled=False):
                return self._emulate(func, name, args, kwargs)
        if self._suspended or name in self._user_fp32:
            if name in self._user_fp32:  # the policy's own FP32 ops win over autocast's lists
                args, kwargs = map_floating((args, kwargs), self._widened)
            return func(*args, **kwargs)
        if name in FP32_OPS:
            args, kwargs = map_floating((args, kwargs), self._widened)
            return func(*args, **kwargs)
        return self._emulate(func, name, args, kwargs)

    def _emulate(self, func, name: str | None, args: tuple, kwargs: dict) -> Any:
        if name in LOWER_PRECISION_OPS:
            if self._refuse is not None:  # a foreign recompute would skip the rounding
                self._refuse("the 16-bit emulation's roundings")
            args, kwargs = map_floating((args, kwargs), self._rounded_fp32)
            if name in _SAVES_OWN_OUTPUT and self._keeps_saved_low():
                return self._keeping_output_low(func, args, kwargs)
            if name in _SAVES_OWN_OUTPUT and self._recomputes_saved():
                return self._rounding_saved_output(func, args, kwargs)
            return map_floating(func(*args, **kwargs), self._to_low)
        if name in _SAME_DTYPE_FP32_OPS and args and isinstance(args[0], torch.Tensor):
            dtype = args[0].dtype
            args, kwargs = map_floating((args, kwargs), self._widened)
            return map_floating(func(*args, **kwargs), lambda t: t.to(dtype) if t.is_floating_point() else t)
        return func(*args, **kwargs)

    def _keeps_saved_low(self) -> bool:
        """Whether what autograd saves now goes through :meth:`pack` (eager, with autograd on)."""
        return self._saving and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _recomputes_saved(self) -> bool:
        """Whether an activation checkpoint's recompute saves for backward now (its hooks, not :meth:`pack`)."""
        return not self._saves_low and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _rounding_saved_output(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """``func``'s 16-bit output, and what its backward saved of the FP32 output rounded like it, as
        :meth:`_keeping_output_low` keeps it: the recompute's gradients equal the forward's."""
        output = func(*args, **kwargs)
        low = self._to_low(output)
        # .data: the saved output's version counter stays, as if it had been made rounded; outside dispatch
        # modes: selective checkpointing replays the forward's ops one for one, and this copy is not one of them
        with _disable_current_modes():
            output.data.copy_(low)
        return low

    def _keeping_output_low(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """``func``'s 16-bit output; what its backward saved of the FP32 output is kept as that output."""
        self._held = held = []
        try:
            output = func(*args, **kwargs)
        finally:
            self._held = None
        low = self._to_low(output)
        where = output.untyped_storage().data_ptr()
        for saved in held:
            if saved.tensor.untyped_storage().data_ptr() == where:
                saved.keep_low(low)
        return low

    def _rounded_fp32(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's values in the 16-bit format, as an FP32 tensor (cached for parameters). A tensor of the other
        16-bit format (a bf16 module's output in an fp16 region) is cast to this one, as autocast casts it."""
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return tensor
        if torch.compiler.is_compiling():  # the compiler plans what backward saves; no caches to trace
            return tensor.to(self.dtype).float()
        is_weight = tensor.dtype == torch.float32 and tensor.is_leaf and tensor.requires_grad
        if is_weight:  # round it once per region
            cached = self._weights.get(id(tensor))
            if cached is not None and cached[0] == tensor._version and cached[1] is tensor:
                return cached[2]
        low = tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)
        rounded = low.float()
        if torch.is_grad_enabled():  # autograd may save it: remember its 16-bit source for pack()
            self._low_of[rounded.untyped_storage().data_ptr()] = (weakref.ref(rounded), low)
        if is_weight:
            self._weights[id(tensor)] = (tensor._version, tensor, rounded)
        return rounded

    def _widened(self, tensor: torch.Tensor) -> torch.Tensor:
        """A 16-bit tensor as FP32 (for FP32 ops); remembered, so autograd saves it at 16 bits."""
        if tensor.dtype not in (torch.float16, torch.bfloat16):
            return tensor
        wide = tensor.float()
        if torch.is_grad_enabled() and tensor.dtype == self.dtype and not torch.compiler.is_compiling():
            self._low_of[wide.untyped_storage().data_ptr()] = (weakref.ref(wide), tensor)
        return wide

    def _to_low(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.dtype == torch.float32 else tensor


@contextlib.contextmanager
def emulations_suspended() -> Iterator[None]:
    """Plain FP32 inside, like ``torch.autocast(enabled=False)``, for every emulated region active on this thread: a
    module kept in FP32 (inside the region, or inside a module computed in the region's other 16-bit format), a bf16
    module of an fp16 region."""
    active = tuple(_ACTIVE.emulations)
    for emulation in active:
        emulation._suspended += 1
    try:
        yield
    finally:
        for emulation in active:
            emulation._suspended -= 1


def widen_rnn_inputs(model: torch.nn.Module) -> None:
    """Give ``model``'s recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) their input in their weights' dtype
    while an emulation is active: a 16-bit activation (a Linear's output before them) met their FP32 weights
    in their own dtype check, which only torch's autocast waives, and failed. The emulation then rounds the
    recurrent op's operands to 16 bits and returns 16-bit outputs (``LOWER_PRECISION_OPS``), as CUDA autocast
    runs it. Installed once per layer and kept (a forward pre-hook, idle where no emulation is active)."""
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase) and _rnn_input_to_weights not in module._forward_pre_hooks.values():
            module.register_forward_pre_hook(_rnn_input_to_weights)


def _rnn_input_to_weights(module: torch.nn.Module, args: tuple) -> tuple | None:
    weights = getattr(module, "_flat_weights", None)
    if not _ACTIVE.emulations or not args or not weights or not isinstance(args[0], torch.Tensor):
        return None
    dtype = weights[0].dtype
    return map_floating(args, lambda tensor: tensor.to(dtype))  # the input and the state (LSTM's (h, c) too)


def active_emulation() -> EmulatedAutocast | None:
    """The innermost emulated region on this thread, if any (for tools that also hook saved tensors)."""
    emulations = _ACTIVE.emulations
    return emulations[-1] if emulations else None
