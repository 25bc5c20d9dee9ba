"""The cost model: predicted step time and activation memory of a per-layer policy, from measured layers.

A device profile holds, for layer shapes, the milliseconds of one training pass of such a layer (forward, input
gradient and weight gradient) in each per-layer format, measured through mixprec's own regions, so the casts,
the FP8 scaling passes and the kernels the compute plan picked are all in the figure. Three kinds of layer:

    GemmShape   a GEMM layer (Linear, Conv1D, the mixprec_gemm protocol): rows ``m`` (tokens or samples per
                batch), ``k`` in features, ``n`` out features; key ``"3072x192x576"``; FP32, 16 bits or FP8
    ConvShape   a convolution (Conv1d/2d/3d): its input and kernel; key ``"conv2d:8x1x8x8:16:k3x3:s1x1:p1x1:d1x1:g1"``;
                FP32 or 16 bits (FP8 computes GEMM layers only)
    AttentionShape  the model's calls of ``F.scaled_dot_product_attention`` (self-attention of one shape), one
                entry for them all; key ``"sdpa:4x8x6x256x64:causal"`` (calls x batch x heads x length x head
                size); FP32 (the base with ``ops=scaled_dot_product_attention``) or 16 bits

and the formats:

    fp32    the layer in FP32 (``fp32_names`` of the policy; attention: ``fp32_ops``)
    bf16    the base policy's 16-bit compute (or fp16: the profile's ``base``)
    fp8     FP8 with current tensorwise scaling (``fp8=hybrid(scaling=current,shapes=all)``: FP8 whatever its speed,
            which is what is measured), on the kernel where the device has one, emulated exactly elsewhere (a CPU:
            slower than 16 bits, which the profile then says)
    bf16    bf16 in an fp16 base (``bf16_names``): for a layer whose values pass fp16's range; timed as the layer
            under mixed_bf16 (measured only where a layer may take it; a bf16 base's profile: its 16 bits)

:func:`measure_profile` times the shapes of the model at hand on the device at hand (a few seconds; the layers
of one shape are timed once). A profile measured elsewhere (``--device-profile FILE``: the GPU check writes one
on each GPU it runs on) is read from JSON; a shape it lacks is predicted from the entry of its kind nearest in
FLOPs, at that entry's throughput (said in the prediction). The predicted step of a policy is the measured step of the
uniform base policy with each layer's time replaced by its format's; from a foreign profile, where no step was
measured, the prediction covers the layers alone and says so. Activation memory counts the input each layer
saves for its backward: 4 bytes a value in FP32, 2 in 16 bits, 1 in FP8 (the FP8 layer saves its quantized
input).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.compute import interleaved_medians, pass_timer, repeats_for, warm_up
from mixprec.persist import check_overwrite, stamped, write_atomically
from mixprec.regions import Region

__all__ = [
    "ATTENTION_OP",
    "BF16",
    "FORMATS",
    "AttentionShape",
    "ConvShape",
    "DeviceProfile",
    "GemmShape",
    "LayerShape",
    "Prediction",
    "layer_policy",
    "measure_profile",
    "predict",
    "shape_from_key",
]

FORMATS = ("fp32", "16", "fp8")  # per layer: FP32, the base policy's 16-bit compute, FP8
BF16 = "bf16"  # and, for a layer of an fp16 base whose values pass fp16's range, bf16 (GEMM layers, convolutions)
SAVED_BYTES = {"fp32": 4, "16": 2, "fp8": 1, BF16: 2}  # per value of the input a GEMM layer saves for its backward
KIND = "device profile"


@dataclass(frozen=True)
class GemmShape:
    """One GEMM layer's product in training: ``m`` rows (tokens or samples per batch) of ``k`` in features
    to ``n`` out features."""

    m: int
    k: int
    n: int

    formats = FORMATS
    kind = "GEMM"

    @property
    def flops(self) -> int:
        return 6 * self.m * self.k * self.n  # forward, input gradient, weight gradient

    @property
    def saved_values(self) -> int:
        return self.m * self.k  # the input, saved for the weight gradient

    def key(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"

    @classmethod
    def from_key(cls, key: str) -> GemmShape:
        """The shape :meth:`key` wrote (``"3072x192x576"``)."""
        m, k, n = (int(v) for v in key.split("x"))
        return cls(m, k, n)

    def module(self) -> nn.Module:
        return nn.Linear(self.k, self.n)

    def example_input(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.m, self.k, generator=generator)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


def _spelled(values: tuple[int, ...]) -> str:
    return "x".join(map(str, values))


@dataclass(frozen=True)
class ConvShape:
    """One convolution layer in training: ``batch`` samples of ``channels`` x ``size`` (its spatial input) to
    ``out_channels``, with its kernel, stride, padding (numbers, or ``"same"``/``"valid"``), dilation and groups."""

    batch: int
    channels: int
    size: tuple[int, ...]
    out_channels: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int = 1

    formats = ("fp32", "16")  # FP8 computes GEMM layers only
    kind = "convolution"

    @classmethod
    def of(cls, module: nn.Module, x: torch.Tensor) -> ConvShape:
        """The shape of ``module`` (a torch ConvNd) called on ``x`` (batched)."""
        padding = module.padding if isinstance(module.padding, str) else tuple(module.padding)
        return cls(
            int(x.shape[0]), int(x.shape[1]), tuple(int(v) for v in x.shape[2:]), module.out_channels,
            tuple(module.kernel_size), tuple(module.stride), padding, tuple(module.dilation), module.groups,
        )  # fmt: skip

    @property
    def output_size(self) -> tuple[int, ...]:
        if self.padding == "same":
            return self.size
        pads = (0,) * len(self.size) if self.padding == "valid" else self.padding
        return tuple(
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, p, d, k, s in zip(self.size, pads, self.dilation, self.kernel, self.stride, strict=True)
        )

    @property
    def flops(self) -> int:  # forward, input gradient, weight gradient: three products of the implicit GEMM
        positions = self.batch * math.prod(self.output_size)
        return 6 * positions * self.out_channels * (self.channels // self.groups) * math.prod(self.kernel)

    @property
    def saved_values(self) -> int:
        return self.batch * self.channels * math.prod(self.size)

    def key(self) -> str:
        padding = self.padding if isinstance(self.padding, str) else _spelled(self.padding)
        return (
            f"conv{len(self.size)}d:{self.batch}x{self.channels}x{_spelled(self.size)}:{self.out_channels}:"
            f"k{_spelled(self.kernel)}:s{_spelled(self.stride)}:p{padding}:d{_spelled(self.dilation)}:g{self.groups}"
        )

    @classmethod
    def from_key(cls, key: str) -> ConvShape:
        """The shape :meth:`key` wrote."""
        _, inputs, out, kernel, stride, padding, dilation, groups = key.split(":")
        batch, channels, *size = _dims(inputs)
        pad = padding[1:] if padding[1:] in ("same", "valid") else _dims(padding[1:])
        return cls(
            batch, channels, tuple(size), int(out), _dims(kernel[1:]), _dims(stride[1:]), pad, _dims(dilation[1:]),
            int(groups[1:]),
        )  # fmt: skip

    def module(self) -> nn.Module:
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(self.size)]
        return conv(
            self.channels, self.out_channels, self.kernel, self.stride, self.padding, self.dilation, self.groups
        )

    def example_input(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.batch, self.channels, *self.size, generator=generator)


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention in training: ``calls`` calls of ``F.scaled_dot_product_attention`` on ``batch`` x
    ``heads`` x ``length`` x ``head_dim`` queries, keys and values (self-attention), causal or not. One entry for
    them all: the policy computes every such call in FP32 or none (``ops=scaled_dot_product_attention``)."""

    calls: int
    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool

    formats = ("fp32", "16")  # FP8 computes GEMM layers only
    kind = "attention"

    @property
    def flops(self) -> int:  # the scores and the weighted values, forward, and twice that backward
        pairs = self.length * self.length // (2 if self.causal else 1)
        return 12 * self.calls * self.batch * self.heads * pairs * self.head_dim

    @property
    def saved_values(self) -> int:
        return 4 * self.calls * self.batch * self.heads * self.length * self.head_dim  # q, k, v and the output

    def key(self) -> str:
        dims = _spelled((self.calls, self.batch, self.heads, self.length, self.head_dim))
        return f"sdpa:{dims}:{'causal' if self.causal else 'full'}"

    @classmethod
    def from_key(cls, key: str) -> AttentionShape:
        """The shape :meth:`key` wrote (``"sdpa:4x8x6x256x64:causal"``)."""
        _, dims, mask = key.split(":")
        calls, batch, heads, length, head_dim = _dims(dims)
        return cls(calls, batch, heads, length, head_dim, mask == "causal")

    def module(self) -> nn.Module:
        return _Attention(self.calls, self.causal)

    def example_input(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(3, self.batch, self.heads, self.length, self.head_dim, generator=generator)


class _Attention(nn.Module):
    """``calls`` attention calls on one packed (3, batch, heads, length, head_dim) input: what a profile times."""

    def __init__(self, calls: int, causal: bool) -> None:
        super().__init__()
        self.calls, self.causal = calls, causal

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        q, k, v = packed.unbind(0)
        outputs = [F.scaled_dot_product_attention(q, k, v, is_causal=self.causal) for _ in range(self.calls)]
        return torch.stack(outputs).sum(0)


LayerShape = GemmShape | ConvShape | AttentionShape
ATTENTION_OP = "scaled_dot_product_attention"  # the op a policy's ops= names to compute attention in FP32


def shape_from_key(key: str) -> LayerShape:
    """The shape a profile key names (``"3072x192x576"``, ``"conv2d:..."``, ``"sdpa:..."``)."""
    if key.startswith("sdpa:"):
        return AttentionShape.from_key(key)
    return ConvShape.from_key(key) if key.startswith("conv") else GemmShape.from_key(key)


def layer_policy(base: str, fmt: str, kind: str = "GEMM") -> str:
    """The policy one layer of format ``fmt`` runs under, on top of ``base`` (a 16-bit preset); attention in FP32
    is the base with that op in FP32, as a tuned policy runs it (its inputs cast up, its output down)."""
    if fmt == "fp32":
        return f"base={base},ops={ATTENTION_OP}" if kind == "attention" else "fp32"
    if fmt == "fp8":
        return f"base={base},fp8=hybrid(scaling=current,keep=none,shapes=all)"
    if fmt == BF16:  # a bf16 module of an fp16 region computes as under mixed_bf16 (a layer alone has no name)
        return "mixed_bf16"
    return base


@dataclass
class DeviceProfile:
    """Measured milliseconds of one training pass per GEMM layer shape and format, on one device."""

    device: str
    base: str  # the 16-bit preset the "16" format stands for (mixed_bf16 or mixed_fp16)
    entries: dict[str, dict[str, float]] = field(default_factory=dict)  # shape key -> format -> ms
    source: str = "measured here"

    def layer_ms(self, shape: LayerShape, fmt: str) -> tuple[float, str | None]:
        """Milliseconds of ``shape`` in ``fmt``, and how it was had when not measured (None if measured): from the
        entry of the same kind (GEMM or convolution) nearest in FLOPs, else from any."""
        fmt = self._stored(fmt)
        if shape.key() in self.entries and fmt in self.entries[shape.key()]:
            return self.entries[shape.key()][fmt], None
        known = [(k, v[fmt]) for k, v in self.entries.items() if fmt in v]
        if not known:
            raise ValueError(f"the device profile ({self.source}) has no {fmt} timing; measure one with this format.")
        kind = [(k, ms) for k, ms in known if isinstance(shape_from_key(k), type(shape))]
        nearest, ms = min(kind or known, key=lambda item: abs(math.log(_flops(item[0]) / shape.flops)))
        other = "" if kind else " (a layer of another kind: the profile has none of this one)"
        return ms * shape.flops / _flops(nearest), f"scaled from {nearest} at its throughput{other}"

    def times(self, fmt: str) -> bool:
        """Whether the profile has timings of ``fmt`` (measured, or its 16 bits for bf16 in a bf16 base's)."""
        fmt = self._stored(fmt)
        return any(fmt in timings for timings in self.entries.values())

    def _stored(self, fmt: str) -> str:
        """The entry ``fmt``'s timings are under: a bf16 base's 16 bits are bf16."""
        return "16" if fmt == BF16 and self.base == "mixed_bf16" else fmt

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (atomically; a file mixprec did not write is refused)."""
        path = check_overwrite(path, "--device-profile", KIND)
        payload = stamped(
            {"device": self.device, "base": self.base, "source": self.source, "layers": self.entries}, KIND
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(payload, indent=1).encode())
        return path

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """Read a profile :meth:`save` wrote (JSON only: nothing in the file runs).

        Raises:
            ValueError: unreadable, not a profile, or malformed entries.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            entries = {
                str(shape): {f: float(ms) for f, ms in timings.items() if f in (*FORMATS, BF16)}
                for shape, timings in data["layers"].items()
            }
            if not entries or any(_flops(shape) <= 0 for shape in entries):
                raise ValueError("no layer timings")
            return cls(str(data["device"]), str(data["base"]), entries, f"{path}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"--device-profile {path}: not a device profile mixprec wrote ({exc}); write one with mixprec tune "
                "--save-profile FILE on that device, or the GPU check's profile part."
            ) from None


def _flops(key: str) -> int:
    return shape_from_key(key).flops


def measure_profile(
    shapes: Iterable[LayerShape],
    base: str,
    device: torch.device,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda message: None,
    formats: Iterable[str] = FORMATS,
) -> DeviceProfile:
    """Time one training pass of a layer of each shape (a Linear, a convolution) in each of ``formats`` it can
    take through mixprec's region on ``device``; the formats take turns, ``repeats`` samples each, the median
    kept."""
    from mixprec.compute import device_caps

    shapes, formats = list(dict.fromkeys(shapes)), list(formats)
    profile = DeviceProfile(device_caps(device.type).description, base)
    for index, shape in enumerate(shapes, 1):
        progress(f"cost model: timing layer shape {shape.key()} ({index}/{len(shapes)})")
        # bf16 where the shape is a module's (attention is an op: bf16_names cannot name it)
        takes = [fmt for fmt in formats if fmt in shape.formats or (fmt == BF16 and shape.kind != "attention")]
        passes = {fmt: _pass(shape, layer_policy(base, fmt, shape.kind), device) for fmt in takes}
        warm_up(passes)  # kernels, caches, the FP8 state
        counts = {fmt: repeats_for(run(1)) for fmt, run in passes.items()}
        medians = interleaved_medians(passes, counts, repeats)
        profile.entries[shape.key()] = {fmt: round(ms, 5) for fmt, ms in medians.items()}
    return profile


def _pass(shape: LayerShape, policy: str, device: torch.device) -> Callable[[int], float]:
    """A function timing ``count`` forward + backward passes of a fresh layer of ``shape`` under ``policy``
    (milliseconds, the device synchronized)."""
    generator = torch.Generator().manual_seed(0)
    layer = shape.module().to(device)
    x = shape.example_input(generator).to(device).requires_grad_()
    region = Region(policy, layer)

    def step() -> None:
        with region.enter():
            out = layer(x)
        out.float().sum().backward()

    return pass_timer(step, device)


@dataclass(frozen=True)
class Prediction:
    """A per-layer policy's predicted cost against the uniform base policy's."""

    step_ms: float
    speedup: float  # the base policy's predicted step over this one's
    activation_ratio: float  # saved GEMM-layer inputs against the base policy's
    scope: str  # "step" (measured base step, layer times replaced) or "layers" (a foreign profile)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(
    assignment: dict[str, str],
    shapes: dict[str, LayerShape],
    profile: DeviceProfile,
    base_step_ms: float | None,
) -> Prediction:
    """The cost of running each layer ``name`` in ``assignment[name]`` (a layer left out: the base's 16 bits);
    ``base_step_ms``: the uniform base policy's measured step on the profile's device, None for a foreign one."""
    notes, base_ms, ms, base_bytes, saved = [], 0.0, 0.0, 0, 0
    for name, shape in shapes.items():
        fmt = assignment.get(name, "16")
        here, how = profile.layer_ms(shape, fmt)
        uniform, how_base = profile.layer_ms(shape, "16")
        notes += [f"{name} {f}: {h}" for f, h in {fmt: how, "16": how_base}.items() if h]
        ms, base_ms = ms + here, base_ms + uniform
        saved += SAVED_BYTES[fmt] * shape.saved_values
        base_bytes += SAVED_BYTES["16"] * shape.saved_values
    if base_step_ms is not None and base_ms > base_step_ms:
        notes.append(
            f"the layers timed alone add up to {base_ms:.1f} ms in 16 bits, more than the whole measured step "
            f"({base_step_ms:.1f} ms): the machine was busy while they were timed, or alone they run slower than "
            "inside the model; this prediction is not to be trusted"
        )
    if base_step_ms is not None:
        # layers timed alone past the whole step are scaled down to fit it (their share taken as the whole
        # step), so a prediction stays positive and the base's own prediction stays its measured step
        fit = min(1.0, base_step_ms / base_ms) if base_ms > 0 else 1.0
        step, scope = base_step_ms - fit * base_ms + fit * ms, "step"
        base = base_step_ms
    else:
        step, scope, base = ms, "layers", base_ms
    return Prediction(
        round(step, 4),
        round(base / step, 4) if step > 0 else 1.0,
        round(saved / base_bytes, 4) if base_bytes else 1.0,
        scope,
        tuple(dict.fromkeys(notes)),
    )
