"""FP8 only where it pays: per GEMM shape, whether one training pass is faster in FP8 than in the compute dtype.

FP8 halves a GEMM's time only when the product is large enough to hide the extra passes over memory that
scaling and casting take (the amaxes, the saturating casts, the transposed copies): on an H200, eager, every
layer of a 4-layer, width-2048 GPT measured 2x slower in FP8 than in bf16. Under a recipe's ``shapes=faster``
(and ``shapes=auto``, the default, where the FP8 GEMM kernel runs, as on CUDA), each selected layer decides at
its first pass with a shape:

    key      the device, torch's version, the recipe's formats, scaling, cast and GEMM path, the compute
             dtype, and the shape: m rows (tokens or samples in the batch), k in features, n out features,
             with or without a bias
    measure  forward + backward of a layer of that shape, in FP8 through the recipe (fresh scale states:
             the model's amax histories are not touched) and in the compute dtype under torch.autocast, on
             the layer's device, with inputs in the compute dtype as a 16-bit model passes them; the two
             take turns, 3 samples of about 5 ms each, the median kept (one pass each where FP8 took over
             3x as long: an emulation, a CPU's kernel)
    decide   FP8 where its pass was faster, else the layer's own forward in the compute dtype

A measurement is taken once per shape and process, and kept in ``$MIXPREC_CACHE_DIR/fp8_shapes.json``
(:mod:`mixprec.compute.cache`), so a machine measures a shape once per torch version. Host-device syncs:
on CUDA, each sample synchronizes the device (once per shape, at its first pass; none after). Nothing is
measured where it cannot be: inside a CUDA graph capture the layer runs FP8 (said in the plan as not
measured). Under torch.compile the decision is made while the step is traced, eagerly, and compiled in as a
constant (:func:`layer_pays` carries the mark ``torch.compiler.assume_constant_result`` sets); a layer whose
row count the compiler made symbolic (a dynamic batch) runs FP8. Under torch.distributed each process
measures for itself: on identical GPUs a shape decides the same way except within timing noise, which
changes only which rounding that rank's layer computes with.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.compute.cache import default_cache_dir, read_cache, store
from mixprec.compute.device import cpu_model
from mixprec.compute.timing import interleaved_medians, measuring_blocked, pass_timer, repeats_for, warm_up
from mixprec.numerics import get_format
from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8.gemm import recipe_uses_kernel
from mixprec.regions.fp8.linear import Fp8LinearState, fp8_linear

__all__ = [
    "CACHE_FILE",
    "CACHE_VERSION",
    "ShapeSpeed",
    "SpeedTable",
    "decides_by_speed",
    "layer_pays",
    "shape_key",
    "time_shape",
]

logger = logging.getLogger("mixprec")

CACHE_FILE = "fp8_shapes.json"
CACHE_VERSION = 2  # 2: the key names the products with fast accumulation
_SAMPLES = 3
_CLEARLY = 3.0  # FP8 this many times slower after one pass: decided without the samples


@dataclass(frozen=True)
class ShapeSpeed:
    """One training pass (forward, input and weight gradients) of a GEMM shape, in FP8 and in the compute dtype."""

    m: int
    k: int
    n: int
    fp8_ms: float
    ref_ms: float
    ref: str  # the compute dtype: "bf16", "fp16"

    @property
    def pays(self) -> bool:
        return self.fp8_ms < self.ref_ms

    def describe(self) -> str:
        return (
            f"{self.m} rows, {self.k} -> {self.n}: FP8 {self.fp8_ms:.3f} ms, {self.ref} {self.ref_ms:.3f} ms "
            f"a training pass"
        )


def decides_by_speed(recipe: Fp8Recipe, device: torch.device) -> bool:
    """Whether ``recipe``'s layers run FP8 only where it measured faster: ``shapes=faster``, or ``auto`` where the
    FP8 GEMM kernel runs (an emulation is never faster; it runs for its numerics)."""
    return recipe.shapes == "faster" or (recipe.shapes == "auto" and recipe_uses_kernel(recipe, device))


_TABLES: weakref.WeakValueDictionary[str, SpeedTable] = weakref.WeakValueDictionary()


class SpeedTable:
    """The speed decisions of one model's FP8 layers under one recipe: what each layer decided last, by name.

    ``measure`` (tests inject one) times a shape: ``(m, k, n, bias, dtype) -> (fp8_ms, ref_ms)``.
    """

    def __init__(
        self,
        recipe: Fp8Recipe,
        device: torch.device,
        measure: Callable[[int, int, int, bool, torch.dtype], tuple[float, float]] | None = None,
    ) -> None:
        self.recipe, self.device = recipe, device
        self.decided: dict[str, ShapeSpeed] = {}  # a layer not measured yet (or only where nothing could be) absent
        self._known: dict[tuple, ShapeSpeed] = {}
        self._measure = measure or self._timed
        self._register()

    def _register(self) -> None:
        self.key = f"{id(self)}"  # what layer_pays finds this table by: a plain value, which torch.compile takes
        _TABLES[self.key] = self

    def __setstate__(self, state: dict) -> None:  # a copy (copy.deepcopy, pickle) is a table of its own
        self.__dict__.update(state)
        self._register()

    def pays(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype) -> bool:
        """Whether layer ``name`` computes this call in FP8: its shape measured faster there (or could not be)."""
        if x.numel() == 0:  # no rows: nothing to time, nothing computed
            return True
        m = x.numel() // x.shape[-1]
        if not _known_while_tracing(m):  # a row count torch.compile made dynamic: no one shape to decide
            return True
        return layer_pays(self.key, name, get_format(dtype).name, m, weight.shape[1], weight.shape[0], bias is not None)

    def speed(self, name: str, dtype: torch.dtype, m: int, k: int, n: int, bias: bool) -> ShapeSpeed | None:
        """The shape's measurement (this process's, the cache's, or taken now), recorded as ``name``'s."""
        shape = (get_format(dtype).name, m, k, n, bias)
        found = self._known.get(shape)
        if found is None:
            found = self._cached_or_measured(dtype, m, k, n, bias)
        if found is not None:  # None (not measured now: a capture, a dispatch mode): measured at a later call
            self._known[shape] = self.decided[name] = found
        return found

    def _cached_or_measured(self, dtype: torch.dtype, m: int, k: int, n: int, bias: bool) -> ShapeSpeed | None:
        if measuring_blocked(self.device):
            return None
        path = default_cache_dir() / CACHE_FILE
        key = shape_key(self.recipe, self.device, dtype, m, k, n, bias)
        entry = read_cache(path, CACHE_VERSION).get(key)
        if _valid(entry):
            return ShapeSpeed(m, k, n, entry["fp8_ms"], entry["ref_ms"], get_format(dtype).name)
        fp8_ms, ref_ms = self._measure(m, k, n, bias, dtype)
        store(path, CACHE_VERSION, key, {"fp8_ms": round(fp8_ms, 5), "ref_ms": round(ref_ms, 5)})
        speed = ShapeSpeed(m, k, n, round(fp8_ms, 5), round(ref_ms, 5), get_format(dtype).name)
        logger.info("mixprec: %s; %s", speed.describe(), "FP8" if speed.pays else f"{speed.ref} kept")
        return speed

    def _timed(self, m: int, k: int, n: int, bias: bool, dtype: torch.dtype) -> tuple[float, float]:
        return time_shape(self.recipe, self.device, dtype, m, k, n, bias)


def _known_while_tracing(size: int) -> bool:
    """Whether ``size`` has one value in the code being run: always eagerly; traced by torch.compile, where it is a
    constant and not a symbol (a dynamic size). Dynamo reads a symbol as an int to ``isinstance`` and ``type``, and
    torch 2.11's reads some other class as a constant's ``__class__``; what a constant has and a symbol lacks
    (even one bounded by ``mark_dynamic(max=)`` or a branch on it) is a known value: here its residues mod 2 and 3,
    which no bound decides (``statically_known_true`` installs no guard: the size is not specialized)."""
    if not torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # loaded by dynamo already

    return all(any(statically_known_true(size % p == r) for r in range(p)) for p in (2, 3))


def layer_pays(table: str, name: str, dtype: str, m: int, k: int, n: int, bias: bool) -> bool:
    """Whether layer ``name`` of speed table ``table`` runs FP8 for an (m, k) input to n outputs in ``dtype``."""
    speed = _TABLES[table].speed(name, get_format(dtype).torch_dtype, m, k, n, bias)
    return speed is None or speed.pays


# torch.compile calls it eagerly while tracing and compiles the answer in as a constant (arguments and answer
# are plain values); the mark torch.compiler.assume_constant_result sets, without importing torch._dynamo
layer_pays._dynamo_marked_constant = True  # type: ignore[attr-defined]


def shape_key(recipe: Fp8Recipe, device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, bias: bool) -> str:
    """The cache key of a shape's measurement: the device (a GPU's name; a CPU's model and threads), torch's
    version, what of the recipe its speed depends on (not which layers it keeps), the compute dtype and the shape,
    e.g. ``NVIDIA H200 | torch 2.11.0 | hybrid current cast=eager gemm=auto fast_accum=output | bf16 |
    8192x2048x8192+bias``."""
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{cpu_model()}, {torch.get_num_threads()} threads"
    fast = "+".join(recipe.fast_products) or "none"
    recipe_tag = f"{recipe.format_name} {recipe.scaling} cast={recipe.cast} gemm={recipe.gemm} fast_accum={fast}"
    shape = f"{m}x{k}x{n}" + ("+bias" if bias else "")
    return f"{machine} | torch {torch.__version__} | {recipe_tag} | {get_format(dtype).name} | {shape}"


def _valid(entry: object) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(entry.get(f), (int, float)) and not isinstance(entry.get(f), bool) and entry[f] > 0
        for f in ("fp8_ms", "ref_ms")
    )


def time_shape(
    recipe: Fp8Recipe, device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, bias: bool
) -> tuple[float, float]:
    """Milliseconds of one training pass of an (m, k) -> n layer in FP8 under ``recipe`` and in ``dtype`` under
    torch.autocast: taking turns, ``_SAMPLES`` samples each, the medians."""
    # whatever the caller is in (a region's autocast and op overrides, no_grad, inference): time a training pass
    with torch.inference_mode(False), torch.enable_grad(), torch._C.DisableTorchFunction():
        generator = torch.Generator().manual_seed(0)  # its own: the model's random streams stay untouched
        x = torch.randn(m, k, generator=generator).to(device, dtype).requires_grad_()
        w = (torch.randn(n, k, generator=generator) / k**0.5).to(device).requires_grad_()
        b = torch.zeros(n, device=device, requires_grad=True) if bias else None
        state = Fp8LinearState(recipe, device)

        def fp8() -> None:
            fp8_linear(x, w, b, state, dtype).float().sum().backward()

        def ref() -> None:
            with torch.autocast(device.type, dtype=dtype):
                y = F.linear(x, w, b)
            y.float().sum().backward()

        runs = {"fp8": pass_timer(fp8, device), "ref": pass_timer(ref, device)}
        warm_up(runs)
        once = {mode: max(run(1), 1e-3) for mode, run in runs.items()}
        if once["fp8"] > _CLEARLY * once["ref"]:  # no closer look needed (an emulation, a CPU kernel: ~100x)
            return once["fp8"], once["ref"]
        medians = interleaved_medians(runs, {mode: repeats_for(ms) for mode, ms in once.items()}, _SAMPLES)
    return medians["fp8"], medians["ref"]
