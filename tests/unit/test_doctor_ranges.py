"""The doctor's range counts agree with what a cast to each format actually does."""

import pytest
import torch

import mixprec
from mixprec.doctor.ranges import HISTOGRAM_LOW, range_counts

FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def _values() -> torch.Tensor:
    torch.manual_seed(0)
    random = torch.randn(20000) * torch.exp2(torch.randint(-40, 40, (20000,)).float())
    edges = []
    for name in FORMATS:
        fmt = mixprec.get_format(name)
        for v in (fmt.min_subnormal, fmt.min_normal, fmt.max, fmt.overflow_threshold):
            edges += [v, v / 2, v * 0.75, v * 1.5, torch.tensor(v).nextafter(torch.tensor(0.0)).item(), v * 2]
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -float("inf")])
    return torch.cat([random, torch.tensor(edges), -torch.tensor(edges), special])


@pytest.mark.parametrize("index", range(len(FORMATS)))
def test_counts_match_the_cast(index):
    x = _values()
    name = FORMATS[index]
    fmt = mixprec.get_format(name)
    counts = range_counts(x, FORMATS).counts.tolist()
    under, sub, over = counts[3 + 3 * index : 6 + 3 * index]
    finite = torch.isfinite(x)
    q = mixprec.quantize(x[finite], name)  # nearest even; e4m3 saturates at max
    xf = x[finite]
    assert under == int(((xf != 0) & (q == 0)).sum())
    assert sub == int(((q != 0) & (q.abs() < fmt.min_normal)).sum())
    reference_over = torch.isinf(q) | ((q.abs() == fmt.max) & (xf.abs() >= fmt.overflow_threshold))
    assert over == int(reference_over.sum())
    assert counts[:3] == [x.numel(), int((x == 0).sum()), int((~finite).sum())]


def test_histogram_counts_binades_and_amax_ignores_non_finite():
    x = torch.tensor([1.0, 1.5, 2.0, 0.25, 0.0, float("inf"), float("nan"), 2.0**-149, -3.0])
    result = range_counts(x, ("fp16",))
    histogram = result.histogram.tolist()
    assert histogram[0 - HISTOGRAM_LOW] == 2  # 1.0 and 1.5
    assert histogram[1 - HISTOGRAM_LOW] == 2  # 2.0 and -3.0
    assert histogram[-2 - HISTOGRAM_LOW] == 1
    assert histogram[0] == 1  # the lowest bin, 2**-127, also holds FP32's subnormals
    assert sum(histogram) == 6
    assert result.amax.item() == 3.0


def test_bf16_inputs_are_counted_like_their_fp32_values():
    x = _values()
    x = x[torch.isfinite(x)].clamp(-1e30, 1e30).bfloat16()
    assert torch.equal(range_counts(x, FORMATS).counts, range_counts(x.float(), FORMATS).counts)
