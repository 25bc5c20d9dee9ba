"""Part ``profile``: the device profile ``mixprec tune --device-profile`` reads, measured on this GPU.

One training pass (forward, input gradient, weight gradient) of a Linear layer per shape, in FP32, in the 16-bit
base (mixed_bf16) and in FP8 with current scaling, through mixprec's own regions (``mixprec.app.tune.cost``): the
GEMM layers of the width-2048 GPT the FP8 goals are set on (batch 8 x 1024 tokens), of GPT-2 small at 8 x 1024,
and of the charlm and minilm tasks as they train by default, and those tasks' attention (FP32 or 16 bits).
Writes ``device_profile.json`` beside ``gpu_check.json``; commit it as
``benchmarks/results/gpu/<device>/device_profile.json``, from where a CPU tunes for this GPU (docs/tune.md). Then the
same with an fp16 base (mixed_fp16; bf16 too, what ``bf16_names`` puts a layer past fp16's range in), for
``mixprec tune --base mixed_fp16``: ``device_profile_fp16.json`` (11 s for the bf16 profile on an H200).
"""

from __future__ import annotations

from benchmarks.gpu.common import Part, Settings, device_slug, log

from mixprec.app.tune.cost import BF16, FORMATS, AttentionShape, GemmShape, LayerShape, measure_profile

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


# the file of each base: the bf16 one first (the one every tune of a bf16 base reads)
FILES = {"mixed_bf16": ("device_profile.json", FORMATS), "mixed_fp16": ("device_profile_fp16.json", (*FORMATS, BF16))}


def run(settings: Settings, part: Part) -> None:
    shapes = _shapes(settings.dry_run)
    folder = settings.out_dir / device_slug(settings)
    for base, (name, formats) in FILES.items():
        profile = part.attempt(
            {"case": "profile", "base": base, "shapes": len(shapes)},
            lambda base=base, formats=formats: measure_profile(
                shapes, base, settings.device, progress=log, formats=formats
            ),
        )
        if profile is None:
            return
        path = profile.save(folder / name)
        for key, timings in profile.entries.items():
            times = {f"{fmt}_ms": ms for fmt, ms in timings.items()}
            part.records.append({"case": "layer pass", "base": base, "shape": key, **times})
        part.meta[f"profile {base}"] = str(path)
        part.progress()
