"""Part ``fp8gpt``: FP8 training where its GEMMs are large enough to pay, beside bf16 and torchao's float8.

The model is the one FP8's goals are set on (docs/fp8.md): TinyGPT, 4 layers of width 2048 (16 heads,
context 1024), batch 8 x 1024 tokens. Rows: the hand-written ``torch.autocast`` bf16 loop, mixprec's
``mixed_bf16``, and FP8 under each per-tensor recipe mixprec runs on the FP8 kernel (``current``, the
default, and ``delayed``) on every layer (``shapes=all``; the per-tensor one also with every product promoted to
FP32, ``fast_accum=none``, beside the default's fast accumulation of the forward product), and ``fp8`` as it runs by
default (each layer in FP8
only where its shape measured faster, ``shapes=auto``; the measurements in the part's record), eager and
compiled, and eager with each operand's cast compiled (``cast=compiled``,
``, compiled cast`` rows: what that option buys); beside them torchao's float8 training (tensorwise and
rowwise, ``convert_to_float8_training`` on the same model, under the same autocast loop) where torchao imports
(carry its wheel: docs/gpu.md).

The table is the gpt part's (ms/step, tokens/s, MFU, peak memory, host time and kernels per step), timed in
interleaved rounds; ``vs torch loop`` is each row against the autocast bf16 loop of the same kind (eager or
compiled), the figure the goals are about: FP8 compiled >= 1.15x bf16 compiled, FP8 eager no slower than
bf16 eager, peak memory <= 0.75x bf16's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings
from benchmarks.gpu.part_gpt import Table, run_table
from benchmarks.gpu.steps import Mode, Workload, make_optimizer, training_mode

from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT
from mixprec.compute.cache import default_cache_dir, read_cache
from mixprec.regions.fp8 import compiled_cast_failures
from mixprec.regions.fp8.shape_speed import CACHE_FILE, CACHE_VERSION

__all__ = ["run"]

LOOP = "torch autocast bf16"
POLICIES = {
    "mixed_bf16": "mixed_bf16",
    "fp8": "fp8",  # FP8 only on the layers whose shape measured faster in FP8 (shapes=auto on CUDA)
    "fp8 all layers": "base=fp8,fp8=(shapes=all)",
    # every product promoted to FP32 (the default asks fast accumulation of the forward product, as torchao does)
    "fp8 all layers, FP32 accumulation": "base=fp8,fp8=(shapes=all,fast_accum=none)",
    "fp8 delayed": "base=fp8,fp8=(scaling=delayed,shapes=all)",
    "fp8 rowwise": "base=fp8,fp8=(scaling=rowwise,shapes=all)",  # beside torchao's rowwise
    "fp8 blockwise": "base=fp8,fp8=(scaling=blockwise,shapes=all)",  # cuBLAS's 1x128 / 128x128 kernel (Hopper)
    # FP8 layers on bf16 weights with the compensated AdamW: 12 bytes a parameter instead of 16 (the memory goal)
    "fp8 on pure_bf16": "base=pure_bf16,fp8=hybrid(shapes=all)",
    "fp8, compiled cast": "base=fp8,fp8=(cast=compiled)",
    "fp8 all layers, compiled cast": "base=fp8,fp8=(cast=compiled,shapes=all)",
    "fp8 delayed, compiled cast": "base=fp8,fp8=(scaling=delayed,cast=compiled,shapes=all)",
}
TORCHAO = {"torchao tensorwise": "tensorwise", "torchao rowwise": "rowwise"}
# compiled while the budget lasts, most telling first (at this width each compile takes 30-50 s on an H200)
COMPILED = (
    LOOP,
    "fp8",
    "fp8 all layers",
    "torchao tensorwise",
    "fp8 all layers, FP32 accumulation",
    "mixed_bf16",
    "fp8 on pure_bf16",
    "torchao rowwise",
    "fp8 delayed",
)


def _torchao_step(work: Workload, device: torch.device, recipe: str, backend: str | None):
    """torchao's float8 training: every Linear but the tied LM head converted, the autocast bf16 loop around it."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = work.build().to(device)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name != "lm_head")
    inputs, targets = work.batch(device)
    optimizer = make_optimizer("fused", model)
    forward = torch.compile(model, backend=backend) if backend else model

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = work.loss(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, None


def _modes(settings: Settings, work: Workload, part: Part) -> list[Mode]:
    device = settings.device
    twins = dict.fromkeys(POLICIES, LOOP)

    def mixprec_mode(name: str, backend: str | None = None) -> Mode:
        return training_mode(name, work, device, backend, twins, POLICIES)

    def torchao_mode(name: str, backend: str | None = None) -> Mode:
        label = f"{name}, compiled" if backend else name
        twin = f"{LOOP}, compiled" if backend else LOOP
        return Mode(label, lambda: _torchao_step(work, device, TORCHAO[name], backend), backend is not None, twin)

    has_torchao = _has_torchao(part)
    rows: dict[str, Callable[[str | None], Mode]] = {LOOP: lambda backend: training_mode(LOOP, work, device, backend)}
    rows.update({name: lambda backend, n=name: mixprec_mode(n, backend) for name in POLICIES})
    if has_torchao:
        rows.update({name: lambda backend, n=name: torchao_mode(n, backend) for name in TORCHAO})
    eager = [make(None) for make in rows.values()]
    if settings.dry_run:
        part.leave_out("compiled rows", "dry run: the gpt part checks compiling; this one shows the rows run")
        return eager
    return eager + [rows[name]("inductor") for name in COMPILED if name in rows]


def _has_torchao(part: Part) -> bool:
    try:
        import torchao.float8
    except Exception as error:  # not installed here, or built for another torch
        part.leave_out(", ".join(TORCHAO), f"torchao.float8 does not import: {type(error).__name__}: {error}"[:300])
        return False
    import torchao

    part.meta["torchao"] = torchao.__version__
    return True


def run(settings: Settings, part: Part) -> None:
    if settings.dry_run:
        config, batch = GPTConfig(layers=2, width=64, heads=2, context=64), 2
    else:
        config, batch = GPTConfig(layers=4, width=2048, heads=16, context=1024), 8
    params = sum(p.numel() for p in TinyGPT(config).parameters())
    part.meta.update(model=f"TinyGPT {config}")
    work = models.tiny_gpt(config, batch)
    table = Table(params, batch, config.context, config.layers, config.width)
    run_table(settings, part, work, table, _modes(settings, work, part))
    # a compiled cast that failed casts eagerly: its rows would time the eager cast, so the record says so
    part.meta["compiled_cast_failures"] = compiled_cast_failures() or "none"
    # what each FP8 layer shape measured, in FP8 and in bf16, where the rows decided by speed (shapes=auto)
    part.meta["fp8_shape_speeds"] = read_cache(default_cache_dir() / CACHE_FILE, CACHE_VERSION) or "none measured"
