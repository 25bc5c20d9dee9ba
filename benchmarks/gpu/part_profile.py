"""Part ``profile``: the device profile ``mixprec tune --device-profile`` reads, measured on this GPU.

One training pass (forward, input gradient, weight gradient) of a Linear layer per shape, in FP32, in the 16-bit
base (mixed_bf16) and in FP8 with current scaling, through mixprec's own regions (``mixprec.app.tune.cost``): the
GEMM layers of the width-2048 GPT the FP8 goals are set on (batch 8 x 1024 tokens), of GPT-2 small at 8 x 1024,
and of the charlm and minilm tasks as they train by default, and those tasks' attention (FP32 or 16 bits).
Writes ``device_profile.json`` beside ``gpu_check.json``; commit it as
``benchmarks/results/gpu/<device>/device_profile.json``, from where a CPU tunes for this GPU (docs/tune.md).
"""

from __future__ import annotations

from benchmarks.gpu.common import Part, Settings, device_slug, log

from mixprec.app.tune.cost import AttentionShape, GemmShape, LayerShape, measure_profile

__all__ = ["run"]


def _shapes(dry_run: bool) -> list[LayerShape]:
    if dry_run:
        return [GemmShape(32, 16, 48), GemmShape(32, 48, 16), AttentionShape(1, 2, 2, 16, 8, causal=True)]
    gpt = [(8192, 2048, 6144), (8192, 2048, 2048), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 2048, 32768)]
    gpt2 = [(8192, 768, 2304), (8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768), (8192, 768, 50257)]
    charlm = [(3072, 192, 576), (3072, 192, 192), (3072, 192, 768), (3072, 768, 192), (3072, 192, 256)]
    minilm = [(4096, 384, 384), (4096, 384, 1536), (4096, 1536, 384), (32, 384, 2)]
    # the tasks' attention, as mixprec tune finds it (calls x batch x heads x length x head size)
    attention = [AttentionShape(4, 24, 6, 128, 32, causal=True), AttentionShape(6, 16, 12, 128, 32, causal=False)]
    return [GemmShape(*shape) for shape in gpt + gpt2 + charlm + minilm] + attention


def run(settings: Settings, part: Part) -> None:
    shapes = _shapes(settings.dry_run)
    profile = part.attempt(
        {"case": "profile", "shapes": len(shapes)},
        lambda: measure_profile(shapes, "mixed_bf16", settings.device, progress=log),
    )
    if profile is None:
        return
    folder = settings.out_dir / device_slug(settings)
    path = profile.save(folder / "device_profile.json")
    for key, timings in profile.entries.items():
        part.records.append({"case": "layer pass", "shape": key, **{f"{fmt}_ms": ms for fmt, ms in timings.items()}})
    part.meta["profile"] = str(path)
    part.progress()
