"""Per-tensor FP8 scaling: power-of-two scales from the current amax or from an amax history.

Everything stays on the device (no host sync). A scale is the largest power of two 2**k with
``amax * 2**k <= max`` of the format, less ``margin`` powers of two; found from the exponent bits of
amax (``frexp``), so it is exact. An amax of zero, or a non-finite one, gives the scale 1; non-finite
amaxes are left out of a delayed history, so one overflowing step does not poison it, and so are zero amaxes
(a fully masked loss, a gated-off branch): read back as the past, a zero gave the scale 1, which flushed the
next steps' small gradients to zero, where the scale before it stays (as Transformer Engine keeps it).
A forward without gradients (an evaluation) records nothing: it would change the training's scales. A skipped
update takes its window's amaxes back out (:meth:`~mixprec.regions.fp8.region.Fp8State.end_window`): a finite
gradient amax that overflowed the update would scale the next ``history`` steps' gradients to zero.

The state a delayed scale reads and writes is tensors only: the amax history, allocated once and updated
in place (``copy_``), and the count of recorded amaxes, a device scalar (``add_``). So recording inside
the FP8 Linear's autograd function (the gradient's in its backward) traces under torch.compile: the
compiler carries in-place updates of tensors into the graph, while an attribute reassigned there (the
history rebuilt by ``torch.cat``) or a count kept in Python is a side effect it refuses, a graph break in
every FP8 layer. "No history yet" is a ``torch.where`` on the count, not a Python branch, and the entries not
recorded yet are zeros (no slicing by the count), so nothing waits for the host. A custom op
(``torch.library.custom_op`` with ``mutates_args``) was not needed: the autograd function carries the
updates as they are, and the compiled FP8 arithmetic equals eager bit for bit. ``state_dict`` reads the count
(a host sync, at checkpoints only) and keeps the format of earlier checkpoints, ``{"history": tensor,
"recorded": int}``.
"""

from __future__ import annotations

import math

import torch

from mixprec.compute.timing import measuring_blocked
from mixprec.numerics.formats import Format, get_format
from mixprec.numerics.quantize import quantize
from mixprec.policy.fp8_recipe import Fp8Recipe

__all__ = [
    "ScaleState",
    "amax_of",
    "cast_to_fp8",
    "cast_to_fp8_storage",
    "delayed_scale",
    "own_scale_cast",
    "power_of_two_scale",
    "saturating_cast",
]


def power_of_two_scale(amax: torch.Tensor, fmt_max: float, margin: int = 0, *, guard: bool = True) -> torch.Tensor:
    """The FP32 scale 2**k, k the largest integer with ``amax * 2**k <= fmt_max``, minus ``margin`` (k within
    [-126, 126]); 1 for a zero, infinite or NaN amax.

    ``guard=False`` leaves that last rule out (four launches fewer, of eight): the scale of such an amax is then
    some power of two, which is right for a tensor cast with its own amax (current scaling), whose values are
    then all zero or hold a non-finite one: zeros and non-finite values cast the same under any scale.
    """
    amax = amax.float()
    # With amax = m * 2**e and limit = fmt_max * 2**-margin = M * 2**E (m, M in [1, 2)), k = E - e - (m > M).
    # In the bits of a binary float, (e + bias) * 2**p + the mantissa's p bits, bits(limit) - bits(amax) floored to
    # a multiple of 2**p (its low bits cleared) is exactly (E - e) * 2**p, less 2**p where the mantissas'
    # difference borrows (m > M): k * 2**p; with bias * 2**p added, the bits of 2**k. Integers throughout, so
    # exact, and no frexp. In FP32's bits (p = 23) a subnormal amax reads as if normal; that is harmless wherever
    # limit >= 1 (the scale is then clamped to 2**126 either way) and wrong below, so there FP64's bits are used,
    # in which every FP32 value is normal.
    mantissa, exponent = math.frexp(fmt_max)  # fmt_max = mantissa * 2**exponent, mantissa in [0.5, 1)
    wide = exponent - 1 - margin < 0  # a limit below 1 (fp4_e2m1's 6 with a margin of 3, say)
    p, bias, ints = (52, 1023, torch.int64) if wide else (23, 127, torch.int32)
    # plain arithmetic on the format's largest value (every format's has a short mantissa): torch.compile traces
    # it even where a dynamic graph makes the margin symbolic
    limit = ((exponent - 1 + bias - margin) << p) + int((2 * mantissa - 1) * (1 << p))
    k_bits = (limit - (amax.double() if wide else amax).view(ints)).bitwise_and_(-(1 << p))
    bits = k_bits.clamp_(-126 << p, 126 << p).add_(bias << p)
    if guard:  # NaN fails both tests
        bits = torch.where((amax > 0) & (amax < math.inf), bits, bias << p)
    scale = bits.view(torch.float64 if wide else torch.float32)
    return scale.float() if wide else scale


def cast_to_fp8(tensor: torch.Tensor, scale: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """``tensor * scale`` rounded to ``fmt`` (nearest even, finite values saturating at ±max), as FP32.

    Non-finite values stay non-finite, so an overflow still reaches the loss scaler: NaN and, where the
    format has an infinity (e5m2), ±inf pass through; ±inf becomes NaN where it has none (e4m3, whose NaN
    is its only non-finite value; PyTorch's own cast would saturate it to ±448, a finite value that would
    train on).
    """
    spec = get_format(fmt)
    if spec.torch_dtype is not None:
        return cast_to_fp8_storage(tensor, scale, spec).float()
    scaled = tensor.float() * scale
    rounded = quantize(scaled.clamp(-spec.max, spec.max), spec)  # formats PyTorch lacks
    return torch.where(torch.isfinite(scaled), rounded, scaled if spec.has_inf else scaled - scaled)  # inf-inf: NaN


def cast_to_fp8_storage(tensor: torch.Tensor, scale: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """:func:`cast_to_fp8` held in the format's PyTorch dtype (1 byte a value), for formats PyTorch has.

    Four launches on an FP32 or bf16 tensor (five otherwise, fp16's conversion to FP32 first): the multiply,
    infinities to NaN (e4m3) or kept (e5m2), the saturating clamp (NaN passes it), PyTorch's own float8 cast
    (one fused pass; mixprec.quantize, which equals it bit for bit, is ten times slower).
    """
    spec = get_format(fmt)
    return saturating_cast(tensor, scale, spec.max, spec.has_inf, spec.torch_dtype)


def saturating_cast(
    tensor: torch.Tensor, scale: torch.Tensor, fmt_max: float, has_inf: bool, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`cast_to_fp8_storage` given the format's largest value, whether it has infinities, and its dtype.

    Traced by torch.compile, a format's infinities are written as bit patterns rather than by the cast: Triton's
    conversion to e5m2 on Hopper saturates (``cvt.rn.satfinite``), so in a compiled step an overflowing
    gradient would come out finite, 57344, and never reach the loss scaler.

    A bf16 tensor is scaled in bf16 (by a one-value scale: the product stays bf16): exact, as bf16 has FP32's
    exponent range and the scale is a power of two (a product that would be subnormal there is far below every
    FP8 format's smallest value, zero either way), and one conversion pass fewer."""
    return _saturate(_scaled(tensor, scale), fmt_max, has_inf, dtype)


def _scaled(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor * scale`` in FP32, or in bf16 for a bf16 tensor (exact there: see :func:`saturating_cast`)."""
    return (tensor if tensor.dtype == torch.bfloat16 else tensor.float()) * scale


def _saturate(scaled: torch.Tensor, fmt_max: float, has_inf: bool, dtype: torch.dtype) -> torch.Tensor:
    """The scaled values cast to ``dtype``: finite ones saturating at ±``fmt_max``, infinities kept or made NaN."""
    if not has_inf:
        return scaled.nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan).clamp_(-fmt_max, fmt_max).to(dtype)
    if torch.compiler.is_compiling():
        bits = scaled.clamp(-fmt_max, fmt_max).to(dtype).view(torch.uint8)
        infinity = _INF_BITS[dtype]
        signed = torch.where(scaled > 0, infinity, infinity | 0x80).to(torch.uint8)
        return torch.where(torch.isinf(scaled), signed, bits).view(dtype)
    return torch.where(torch.isinf(scaled), scaled, scaled.clamp(-fmt_max, fmt_max)).to(dtype)


_INF_BITS = {torch.float8_e5m2: 0x7C}  # +inf's bits in each FP8 dtype that has one (-inf: with the sign bit)


def own_scale_cast(tensor: torch.Tensor, scale: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """:func:`cast_to_fp8_storage` where ``scale`` came from ``tensor``'s own amax (per tensor, row or tile, by
    :func:`power_of_two_scale`): eagerly three launches in e4m3 and two in e5m2, against four and five.

    Such a scale keeps every finite value within the format's largest: it is the largest power of two that keeps
    the amax there, and an infinite amax gives one below 2**-112, which keeps every finite FP32 value within. So
    the saturating clamp has nothing to clamp. Infinities still become what :func:`cast_to_fp8` promises: NaN in
    e4m3 (PyTorch's cast would saturate them to ±448), kept in e5m2, whose eager cast keeps them where a probe
    says so for that device and pair of dtypes (once each: a host sync; CUDA's and the CPU's do, cuda_fp8's
    ``__NV_SATFINITE`` would not). A NaN amax gives some scale (2**126 for a NaN with its sign bit set, which can
    turn e5m2's finite values into ±inf), and the tensor holds that NaN whatever the rest becomes. Traced by
    torch.compile (Triton's conversions saturate), while a CUDA graph is captured or under a dispatch mode (no
    probe there), the full saturating cast."""
    spec = get_format(fmt)
    scaled = _scaled(tensor, scale)
    if torch.compiler.is_compiling():
        return _saturate(scaled, spec.max, spec.has_inf, spec.torch_dtype)
    if not spec.has_inf:
        return scaled.nan_to_num_(nan=math.nan, posinf=math.nan, neginf=math.nan).to(spec.torch_dtype)
    if _cast_keeps_infinities(scaled.device, scaled.dtype, spec.torch_dtype):
        return scaled.to(spec.torch_dtype)
    return _saturate(scaled, spec.max, spec.has_inf, spec.torch_dtype)


_KEEPS_INFINITIES: dict[tuple, bool] = {}


def _cast_keeps_infinities(device: torch.device, source: torch.dtype, target: torch.dtype) -> bool:
    """Whether PyTorch's eager cast from ``source`` to ``target`` (a format with infinities) on ``device`` keeps
    ±inf and NaN (probed once per triple: a host sync)."""
    key = (device, source, target)
    if key not in _KEEPS_INFINITIES:
        if measuring_blocked(device):  # the full cast, and the probe at the next plain eager call
            return False
        values = torch.tensor([math.inf, -math.inf, math.nan, 1.0], device=device, dtype=source)
        cast = values.to(target).float().cpu()
        _KEEPS_INFINITIES[key] = torch.equal(cast.nan_to_num(nan=7.0), values.float().cpu().nan_to_num(nan=7.0))
    return _KEEPS_INFINITIES[key]


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``tensor`` as an FP32 scalar on its device (NaN if it holds a NaN): one pass. An empty
    tensor's is 0 (an MoE expert given no tokens; torch's inf-norm refuses an empty tensor)."""
    if tensor.numel() == 0:  # the shape: no host sync
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    if torch.is_grad_enabled():  # inside the FP8 layer's autograd function it is not: no detach to dispatch
        tensor = tensor.detach()
    return torch.linalg.vector_norm(tensor, float("inf"), dtype=torch.float32)


def delayed_scale(
    current: torch.Tensor, history: torch.Tensor, recorded: torch.Tensor, fmt_max: float, margin: int, amax_rule: str
) -> torch.Tensor:
    """The scale from the amax ``history`` reduced by ``amax_rule`` ("max" or "recent"; the ``current`` amax while
    nothing is recorded), then ``current`` recorded: both updated in place (see the module docstring).

    The entries not recorded yet are zeros (the history starts so, recording shifts them along, loading zeroes
    them), so the largest is the largest of those recorded, with no mask by a device count (which would wait for
    the host). A non-finite amax (an overflowing step, skipped) and a zero one are left out, so the next scale
    comes from the amaxes before them (no device-to-host read: both updates are masked)."""
    past = history.max() if amax_rule == "max" else history[0]
    scale = power_of_two_scale(torch.where(recorded > 0, past, current), fmt_max, margin)
    kept = (current > 0) & (current < math.inf)  # an amax is >= 0 or NaN
    shifted = torch.cat([current.reshape(1), history[:-1]])  # cat first: no overlapping copy
    history.copy_(torch.where(kept, shifted, history))
    recorded.add_(kept)
    return scale


class ScaleState:
    """The scale of one tensor role (a layer's input, weight or gradient) under a recipe.

    Delayed scaling keeps ``history`` (amaxes, newest at index 0) and ``recorded`` (how many amaxes were
    recorded, a device scalar); recording updates both in place (see the module docstring).
    """

    def __init__(self, fmt: str, recipe: Fp8Recipe, device: torch.device | str | None = None) -> None:
        self.fmt = fmt
        self.recipe = recipe
        self.format = get_format(fmt)  # resolved once: a compiled step does no lookup by name
        self.max = self.format.max
        # Never inference tensors, wherever made: a state first made in an evaluation under torch.inference_mode
        # (Lightning's predict or validate before fit) is the one training records into in place after it
        with torch.inference_mode(False):
            self.history = torch.zeros(recipe.history, dtype=torch.float32, device=device)
            self.recorded = torch.zeros((), dtype=torch.int64, device=device)

    def to(self, device: torch.device) -> None:
        """Keep the state on ``device`` (a history loaded on the CPU, a model moved after setup)."""
        if self.history.device != device:
            with torch.inference_mode(False):  # see __init__
                self.history, self.recorded = self.history.to(device), self.recorded.to(device)

    def scale_for(self, tensor: torch.Tensor, record: bool = True) -> torch.Tensor:
        """The scale to cast ``tensor`` with; records its amax for later (delayed) scales, unless not ``record``."""
        self.to(tensor.device)
        return self.scale_from(amax_of(tensor), record)

    def scale_from(self, current: torch.Tensor, record: bool = True) -> torch.Tensor:
        """The scale for a tensor whose amax is ``current`` (on this state's device); a delayed state records it,
        unless not ``record`` (a forward without gradients)."""
        if self.recipe.scaling != "delayed":  # the tensor's own amax: no guard needed (power_of_two_scale)
            return power_of_two_scale(current, self.max, self.recipe.margin, guard=False)
        history, recorded = self.tensors(record)
        return delayed_scale(current, history, recorded, self.max, self.recipe.margin, self.recipe.amax)

    def tensors(self, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The history and count a delayed scale reads and updates: these, or (not ``record``) copies of them."""
        if record:
            return self.history, self.recorded
        return self.history.clone(), self.recorded.clone()

    def state_dict(self) -> dict:
        """The history and the count as an int (reads one device scalar: a host sync, at checkpoints only)."""
        return {"history": self.history.clone(), "recorded": int(self.recorded)}

    def load_state_dict(self, state: dict) -> None:
        history = state["history"]
        if not isinstance(history, torch.Tensor) or history.shape != (self.recipe.history,):
            raise ValueError(f"FP8 scale state: expected an amax history of {self.recipe.history} values.")
        # onto the state's device; a state still on the CPU moves to the tensors' device on first use
        recorded = int(state["recorded"])
        with torch.inference_mode(False):  # see __init__
            history = history.detach().to(self.history.device, torch.float32, copy=True)
            history[max(recorded, 0) :] = 0.0  # never recorded: zeros, as _past_amax reads them
            self.history = history
            self.recorded = torch.tensor(recorded, dtype=torch.int64, device=self.history.device)
