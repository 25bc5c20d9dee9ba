"""The FP8 recipe of a policy: which formats, how tensors are scaled, which layers stay high precision.

    forward     format of a Linear layer's inputs and weights (fp8_e4m3)
    backward    format of the gradients flowing into it: fp8_e5m2 ("hybrid", more range) or fp8_e4m3
    scaling     "current" (default): each tensor is scaled by its own amax, measured just before the cast;
                "delayed": by the amax history of earlier steps (``history`` entries, reduced by
                ``amax`` = "max" or "recent"), as Transformer Engine does; the first call, with no
                history yet, uses the current amax;
                "rowwise": a current scale per row of each GEMM operand, orthogonal to the product's
                reduction (tokens and output features forward), as torchao's rowwise recipe; on PyTorch's FP8 GEMM
                where ``gemm`` picks it (its rowwise scales), else emulated;
                "blockwise": a current scale per 1x128 tile of activations and gradients and per 128x128
                tile of weights, DeepSeek-V3's recipe; emulated;
                "mxfp8": blocks of 32 along each product's reduction with an E8M0 scale (OCP MX v1.0),
                elements in the recipe's formats; emulated;
                "mxfp4", "nvfp4": FP4 training, every operand in fp4_e2m1 (so FORMATS stays ``hybrid``):
                MXFP4 blocks of 32 with E8M0 scales, or NVFP4 blocks of 16 with e4m3 scales times an FP32
                tensor scale (weights in 16x16 tiles), as NVIDIA's NVFP4 recipe, gradients rounded
                stochastically, the weight gradient's operands rotated by a random Hadamard transform;
                emulated (:mod:`mixprec.regions.fp8.fp4`)
    margin      extra powers of two of headroom below the format's largest value
    scale_rule  MXFP8's E8M0 block scales (``scaling=mxfp8``): "ocp" (default: the OCP rule, amax's exponent less
                the element's largest; torchao's FLOOR) or "ceil" (the smallest power of two that keeps the block
                within range, never saturating: NVIDIA's choice for MXFP8 in cuBLAS and Transformer Engine, and
                torchao's MXFP8 training default, RCEIL); :func:`mixprec.quantize`'s ``scale_rule``
    keep        GEMM layers left in the policy's compute dtype: name globs, plus "first" and "last" for the
                first and last GEMM layers in the model's registration order, and "head" for the
                language-model head (a layer whose weight is an embedding's, else one named lm_head);
                default "head", as FP8 training recipes keep it; "none" keeps none
    only        name globs: only the GEMM layers matching one run FP8 (less those ``keep`` keeps), the others
                stay in the compute dtype; default: every GEMM layer ("all"). A per-layer policy: FP8 for the
                MLP projections (``only=*.mlp.*``), the compute dtype for the rest, FP32 where the policy's
                ``fp32_names`` say
    gemm        "auto" (PyTorch's FP8 GEMM on CUDA devices that have it, the emulation elsewhere),
                "scaled_mm" (the kernel wherever PyTorch has one, the CPU included) or "emulated"
    cast        how the per-tensor scalings (current, delayed) cast each operand after its amax: "eager"
                (default: PyTorch's operations one by one, about ten launches) or "compiled" (the scale, the
                saturating cast and the delayed history's update in one pass compiled by Inductor, on any
                device it compiles for; the same values, a NaN's sign bit aside;
                :mod:`mixprec.regions.fp8.fused_cast`). A run may resume under the other (as under another ``shapes``)
    shapes      which selected layers run FP8 by speed: "faster" (each layer in FP8 only where one training pass
                of its GEMM shape measured faster in FP8 than in the compute dtype on this device; measured
                once per shape and cached, :mod:`mixprec.regions.fp8.shape_speed`), "all" (every selected
                layer, whatever its speed) or "auto" (default: "faster" where the FP8 GEMM kernel runs, as
                on CUDA; "all" where FP8 is emulated, which is there for its numerics, never for speed)
    fast_accum  which products of the per-tensor and rowwise layers ask PyTorch's FP8 GEMM for fast
                accumulation (``use_fast_accum``: on Hopper the tensor cores' partial sums are never promoted to
                FP32, faster and less precise): "output" (the forward product, as torchao's float8 training
                and Transformer Engine run it; "auto", the default, is "output" for those scalings and "none"
                for the others), "all" (the gradients' products too) or "none" (every product promoted).
                The emulation and the CPU's kernel accumulate in FP32 whatever it says. A run may resume
                under another (as under another ``cast``)

Scales are powers of two, so scaling is exact and the emulation equals a scaled cast bit for bit.

A recipe is one value of the policy string, ``fp8=FORMATS`` or ``fp8=FORMATS(key=value,...)``: FORMATS is
``hybrid`` (e4m3 forward, e5m2 gradients), ``e4m3``, ``e5m2`` or ``FORWARD/BACKWARD``; the keys are the
fields above (``keep`` entries joined by ``+``). ``str(recipe)`` writes only the fields that differ from
the defaults, and parses back to the same recipe.

Example:
    >>> str(Fp8Recipe(scaling="delayed", keep=("first", "last")))
    'hybrid(scaling=delayed,keep=first+last)'
    >>> str(Fp8Recipe(keep=()))
    'hybrid(keep=none)'
    >>> parse_recipe("e4m3(history=4)") == Fp8Recipe(backward="fp8_e4m3", history=4)
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mixprec.checks import shown
from mixprec.numerics.block_formats import SCALE_RULES

__all__ = [
    "AMAX_REDUCTIONS",
    "CAST_CHOICES",
    "FAST_ACCUM_CHOICES",
    "FP4_SCALINGS",
    "FP8_FORMATS",
    "GEMM_CHOICES",
    "GEMM_PRODUCTS",
    "SCALINGS",
    "SHAPE_CHOICES",
    "Fp8Recipe",
    "parse_recipe",
]

GEMM_CHOICES = ("auto", "emulated", "scaled_mm")
CAST_CHOICES = ("eager", "compiled")
SHAPE_CHOICES = ("auto", "faster", "all")
FAST_ACCUM_CHOICES = ("auto", "output", "all", "none")
FAST_ACCUM_SCALINGS = ("current", "delayed", "rowwise")  # their products run on PyTorch's FP8 GEMM
GEMM_PRODUCTS = ("output", "input_grad", "weight_grad")  # a GEMM layer's three products, forward first
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
SCALINGS = ("current", "delayed", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")
FP4_SCALINGS = ("mxfp4", "nvfp4")  # every operand in fp4_e2m1: the FP8 formats do not apply
AMAX_REDUCTIONS = ("max", "recent")
_SEPARATORS = ",+=() "  # the policy grammar's
_FORMAT_NAMES = {"hybrid": ("fp8_e4m3", "fp8_e5m2"), "e4m3": ("fp8_e4m3", "fp8_e4m3"), "e5m2": ("fp8_e5m2", "fp8_e5m2")}
_OPTIONS = (
    "scaling",
    "history",
    "amax",
    "margin",
    "scale_rule",
    "keep",
    "only",
    "gemm",
    "cast",
    "shapes",
    "fast_accum",
)  # the keys inside the parentheses


@dataclass(frozen=True)
class Fp8Recipe:
    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    scaling: str = "current"
    history: int = 16
    amax: str = "max"
    margin: int = 0
    scale_rule: str = "ocp"
    keep: tuple[str, ...] = ("head",)
    only: tuple[str, ...] = ()  # every GEMM layer
    gemm: str = "auto"
    cast: str = "eager"
    shapes: str = "auto"
    fast_accum: str = "auto"

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value not in FP8_FORMATS:
                raise ValueError(
                    f"Fp8Recipe({name}=...): received {shown(value)}; use one of {', '.join(FP8_FORMATS)}."
                )
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe(scaling=...): received {self.scaling!r}; use one of {', '.join(SCALINGS)}.")
        if self.scaling in FP4_SCALINGS and (self.forward, self.backward) != ("fp8_e4m3", "fp8_e5m2"):
            raise ValueError(
                f"Fp8Recipe(scaling={self.scaling!r}) computes every operand in fp4_e2m1, so the FP8 formats "
                f"{self.format_name} would be ignored; write hybrid(scaling={self.scaling})."
            )
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(
                f"Fp8Recipe(scale_rule=...): received {shown(self.scale_rule)}; use one of {', '.join(SCALE_RULES)}."
            )
        if self.scale_rule != "ocp" and self.scaling != "mxfp8":
            raise ValueError(
                f"Fp8Recipe(scale_rule={self.scale_rule!r}) chooses how MXFP8's E8M0 block scales round "
                f"(scaling=mxfp8); leave it out under scaling={self.scaling!r}."
            )
        if self.amax not in AMAX_REDUCTIONS:
            raise ValueError(f"Fp8Recipe(amax=...): received {self.amax!r}; use one of {', '.join(AMAX_REDUCTIONS)}.")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"Fp8Recipe(gemm=...): received {self.gemm!r}; use one of {', '.join(GEMM_CHOICES)}.")
        if self.cast not in CAST_CHOICES:
            raise ValueError(f"Fp8Recipe(cast=...): received {self.cast!r}; use one of {', '.join(CAST_CHOICES)}.")
        if self.shapes not in SHAPE_CHOICES:
            raise ValueError(f"Fp8Recipe(shapes=...): received {self.shapes!r}; use one of {', '.join(SHAPE_CHOICES)}.")
        if self.fast_accum not in FAST_ACCUM_CHOICES:
            raise ValueError(
                f"Fp8Recipe(fast_accum=...): received {self.fast_accum!r}; use one of {', '.join(FAST_ACCUM_CHOICES)}."
            )
        if self.fast_accum in ("output", "all") and self.scaling not in FAST_ACCUM_SCALINGS:
            raise ValueError(
                f"Fp8Recipe(fast_accum={self.fast_accum!r}) applies to the per-tensor and rowwise layers "
                f"(scaling=current, delayed or rowwise), not to scaling={self.scaling!r}: use auto or none."
            )
        if self.cast == "compiled" and self.scaling not in ("current", "delayed"):
            raise ValueError(
                f"Fp8Recipe(cast='compiled') compiles the per-tensor casts (scaling=current or delayed); "
                f"scaling={self.scaling!r} casts per row or block: leave cast out."
            )
        if not isinstance(self.history, int) or isinstance(self.history, bool) or self.history < 1:
            raise ValueError(f"Fp8Recipe(history=...): received {self.history!r}; use a positive number of steps.")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"Fp8Recipe(margin=...): received {self.margin!r}; use 0 or more powers of two.")
        for name in ("keep", "only"):
            object.__setattr__(self, name, _globs(name, getattr(self, name)))

    def fast_accumulation(self, product: str) -> bool:
        """Whether ``product`` (one of :data:`GEMM_PRODUCTS`) asks the kernel for fast accumulation."""
        if product not in GEMM_PRODUCTS:  # a misspelt product would ask for none, silently
            raise ValueError(f"fast_accumulation(product=...): received {product!r}; use one of {GEMM_PRODUCTS}.")
        if self.fast_accum == "auto":
            return product == "output" and self.scaling in FAST_ACCUM_SCALINGS
        return self.fast_accum == "all" or (self.fast_accum == "output" and product == "output")

    @property
    def fast_products(self) -> tuple[str, ...]:
        """The products (of :data:`GEMM_PRODUCTS`) that ask the kernel for fast accumulation, forward first."""
        return tuple(p for p in GEMM_PRODUCTS if self.fast_accumulation(p))

    @property
    def precision(self) -> str:
        """What the recipe's GEMM layers compute in, as said to users: "FP4" for the FP4 scalings, else "FP8"."""
        return "FP4" if self.scaling in FP4_SCALINGS else "FP8"

    @property
    def format_name(self) -> str:
        """ "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3" (both), as the policy grammar spells it."""
        if self.forward == "fp8_e4m3" and self.backward == "fp8_e5m2":
            return "hybrid"
        if self.forward == self.backward:
            return self.forward.removeprefix("fp8_")
        return f"{self.forward.removeprefix('fp8_')}/{self.backward.removeprefix('fp8_')}"

    def __str__(self) -> str:
        default = Fp8Recipe()
        changed = [name for name in _OPTIONS if getattr(self, name) != getattr(default, name)]
        options = ",".join(f"{name}={_spelled(name, getattr(self, name))}" for name in changed)
        return f"{self.format_name}({options})" if options else self.format_name


def _globs(name: str, value: object) -> tuple[str, ...]:
    """``keep``'s or ``only``'s entries, checked: a tuple of name globs without the grammar's separators."""
    if (
        isinstance(value, str)
        or not isinstance(value, tuple)
        or not all(isinstance(k, str) and k.strip() for k in value)
    ):
        raise TypeError(f"Fp8Recipe({name}=...) takes a tuple of name globs; received {value!r}.")
    bad = [k for k in value if any(c in k for c in _SEPARATORS)]
    if bad:
        raise ValueError(f"Fp8Recipe({name}=...): {bad!r} contain separators of the policy grammar ({_SEPARATORS!r}).")
    return tuple(dict.fromkeys(k.strip() for k in value))


def _spelled(name: str, value: object) -> str:
    if isinstance(value, tuple):
        return "+".join(value) if value else _EMPTY[name]
    return str(value)


_EMPTY = {"keep": "none", "only": "all"}  # an empty tuple: keep none; FP8 for every GEMM layer


def parse_recipe(text: str, base: Fp8Recipe | None = None) -> Fp8Recipe:
    """The recipe ``text`` spells (``hybrid``, ``e4m3(scaling=current,keep=first+last)``), starting from
    ``base`` (default: ``Fp8Recipe()``); with a base, the formats may be left out: ``(history=4)``.

    Raises:
        ValueError: unknown formats or keys, a malformed option, or a value the recipe refuses.
    """
    formats, _, rest = text.strip().partition("(")
    if rest and not rest.endswith(")"):
        raise ValueError(f"fp8={shown(text)}: options go in one pair of parentheses, e.g. hybrid(scaling=current).")
    changes: dict[str, object] = {}
    formats = formats.strip().lower()
    if formats:
        changes["forward"], changes["backward"] = _formats(formats, text)
    elif base is None:
        raise ValueError(f"fp8={shown(text)}: name the formats first: hybrid, e4m3, e5m2 or FORWARD/BACKWARD.")
    for option in filter(str.strip, rest.removesuffix(")").split(",")):
        key, sep, value = (s.strip() for s in option.partition("="))
        if not sep or key.lower() not in _OPTIONS:
            raise ValueError(
                f"fp8={shown(text)}: unknown option {shown(option.strip())}; "
                f"write key=value with key one of {', '.join(_OPTIONS)}."
            )
        changes[key.lower()] = _option_value(key.lower(), value, text)
    try:
        return dataclasses.replace(base or Fp8Recipe(), **changes)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fp8={shown(text)}: {exc}") from None


def _formats(name: str, text: str) -> tuple[str, str]:
    if name in _FORMAT_NAMES:
        return _FORMAT_NAMES[name]
    forward, slash, backward = name.partition("/")
    pair = (f"fp8_{forward}", f"fp8_{backward}")
    if slash and all(f in FP8_FORMATS for f in pair):
        return pair
    raise ValueError(
        f"fp8={shown(text)}: unknown formats {shown(name)}; use hybrid (e4m3 forward, e5m2 gradients), e4m3, e5m2, "
        "FORWARD/BACKWARD (e4m3/e5m2) or none."
    )


def _option_value(key: str, value: str, text: str) -> object:
    if key in _EMPTY:
        return tuple(v for v in value.split("+") if v.strip()) if value.lower() != _EMPTY[key] else ()
    if key in ("history", "margin"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"fp8={shown(text)}: {key}={shown(value)} is not a whole number.") from None
    return value.lower()
