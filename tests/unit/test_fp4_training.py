"""FP4 training recipes (scaling=nvfp4, scaling=mxfp4): each product against a reference built from the public
block formats, the Hadamard rotation, the stochastic gradients' bias, and the recipe's grammar."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec.policy import Fp8Recipe
from mixprec.regions.fp8 import Fp8LinearState, fp8_linear
from mixprec.regions.fp8.fp4 import hadamard_rotation, rotate_tokens


def _layer(scaling, x, w, grad, seed=0):
    """y, dx, dw of one FP4 layer (no bias), the stochastic draws from ``seed``."""
    x, w = x.clone().requires_grad_(), nn.Parameter(w.clone())
    torch.manual_seed(seed)
    y = fp8_linear(x, w, None, Fp8LinearState(Fp8Recipe(scaling=scaling)), torch.float32)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


def _data(device, tokens=40):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 64, generator=gen) * torch.logspace(-2, 2, tokens).unsqueeze(1)  # rows of 4 decades
    w = torch.randn(48, 64, generator=gen)
    w[:16, :16] *= 100  # one 16x16 tile of another range: its own scale
    grad = torch.randn(tokens, 48, generator=gen)
    return x.to(device), w.to(device), grad.to(device)


def _nvfp4_tiles_reference(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 with a scale per 16x16 tile, spelled out tile by tile: the tensor's FP32 scale, each tile's e4m3
    scale by torch's float8 cast, the elements through mixprec's e2m1 rounding (held bit for bit to a table in
    tests/differential/test_block_formats.py)."""
    tensor_scale = w.abs().amax() / (448 * 6)
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], 16):
        for c in range(0, w.shape[1], 16):
            tile = w[r : r + 16, c : c + 16]
            block_scale = (tile.abs().amax() / 6 / tensor_scale).to(torch.float8_e4m3fn).float()
            scale = block_scale * tensor_scale
            out[r : r + 16, c : c + 16] = mixprec.quantize(tile / scale, "fp4_e2m1", saturate=True) * scale
    return out


def test_nvfp4_forward_takes_1x16_activation_blocks_and_16x16_weight_tiles(device):
    x, w, grad = _data(device)
    y, _, _ = _layer("nvfp4", x, w, grad)
    weight = _nvfp4_tiles_reference(w)
    assert torch.equal(y, mixprec.quantize(x, "nvfp4") @ weight.t())
    one_dimensional = mixprec.quantize(x, "nvfp4") @ mixprec.quantize(w, "nvfp4").t()
    assert (y - one_dimensional).abs().max() > 0  # the tiles are not the 1x16 blocks


def test_mxfp4_forward_takes_blocks_of_32_along_the_reduction(device):
    x, w, grad = _data(device)
    y, _, _ = _layer("mxfp4", x, w, grad)
    assert torch.equal(y, mixprec.quantize(x, "mxfp4") @ mixprec.quantize(w, "mxfp4").t())


def test_the_hadamard_rotation_is_orthogonal_and_keeps_the_weight_gradient(device):
    rotation = hadamard_rotation(device)
    assert torch.equal(rotation @ rotation.t(), torch.eye(16, device=device))  # entries ±1/4: exact
    assert set(rotation.abs().unique().tolist()) == {0.25}
    _, _, grad = _data(device, tokens=40)  # 40 tokens: the last group of 16 padded with zero rows
    x, _, _ = _data(device, tokens=40)
    rotated = rotate_tokens(grad, rotation).t() @ rotate_tokens(x, rotation)
    exact = grad.t() @ x
    assert torch.allclose(rotated, exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("scaling", ["nvfp4", "mxfp4"])
def test_stochastic_gradients_average_to_the_unrounded_ones(scaling, device):
    """Each gradient is rounded stochastically, so over many draws the products' mean approaches the product
    with the gradient unrounded; rounded to nearest, the same gradient keeps its whole error."""
    x, w, grad = _data(device)
    fmt = scaling
    draws = [_layer(scaling, x, w, grad, seed=s) for s in range(200)]
    mean_dx = torch.stack([d[1] for d in draws]).mean(0)
    mean_dw = torch.stack([d[2] for d in draws]).mean(0)
    weight = _nvfp4_tiles_reference(w) if scaling == "nvfp4" else mixprec.quantize(w.t(), fmt).t()
    rotation = hadamard_rotation(device)
    rotated_grad, rotated_x = rotate_tokens(grad, rotation), rotate_tokens(x, rotation)
    quantized_x = mixprec.quantize(rotated_x.t(), fmt).t()
    rule = {"scale_rule": "ceil"} if scaling == "mxfp4" else {}  # MXFP4's gradients: the scale that never saturates
    targets = {  # the gradient unrounded, everything else as the layer quantizes it
        "dx": (mean_dx, grad @ weight, mixprec.quantize(grad, fmt, **rule) @ weight),
        "dw": (mean_dw, rotated_grad.t() @ quantized_x, mixprec.quantize(rotated_grad.t(), fmt, **rule) @ quantized_x),
    }
    for name, (mean, target, nearest) in targets.items():
        assert (mean - target).norm() < 0.25 * (nearest - target).norm(), name
    assert torch.equal(draws[0][1], _layer(scaling, x, w, grad, seed=0)[1])  # a seeded run repeats exactly


def test_fp4_recipes_parse_back_and_refuse_fp8_formats():
    policy = mixprec.get_policy("base=fp8,fp8=hybrid(scaling=nvfp4)")
    assert str(policy.fp8) == "hybrid(scaling=nvfp4)" and mixprec.get_policy(str(policy)) == policy
    refused = r"scaling='mxfp4'\) computes every operand in fp4_e2m1.*hybrid\(scaling=mxfp4\)"
    with pytest.raises(ValueError, match=refused):
        mixprec.get_policy("base=fp8,fp8=e4m3(scaling=mxfp4)")
