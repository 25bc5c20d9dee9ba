"""Activation checkpointing inside a policy's region: gradients with mixprec.checkpoint equal those without it,
bit for bit, under every kind of region (native, emulated, hybrid; FP32 ops and modules; GEMM attention)."""

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import mixprec


class Block(nn.Module):
    """Attention, a LayerNorm, an MLP, dropout and a softmax: ops from every list a region treats differently."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        hidden = self.drop(F.gelu(self.up(x + attended)))
        return x + self.down(hidden).softmax(-1)


class Stage(nn.Module):
    """Blocks, each checkpointed (or not) by this module's own forward."""

    def __init__(self, blocks: int, checkpointed: bool, via: Callable, **checkpoint_options) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.checkpointed = checkpointed
        self.via = via
        self.options = checkpoint_options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.via(block, x, **self.options) if self.checkpointed else block(x)
        return x


class Net(nn.Module):
    def __init__(self, checkpointed: bool, via: Callable = mixprec.checkpoint, **checkpoint_options) -> None:
        super().__init__()
        self.stage = Stage(3, checkpointed, via, **checkpoint_options)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(x))


def _gradients(policy: str, device: str, checkpointed: bool, **checkpoint_options) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net(checkpointed, **checkpoint_options).to(device)
    optimizer = (mixprec.AdamW if "pure" in policy else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    x = torch.randn(4, 6, 16, device=device, requires_grad=True)  # the reentrant checkpoint needs one input that does
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    return [p.grad.clone() for p in model.parameters()]


def _assert_equal(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b), f"largest difference {(a.float() - b.float()).abs().max().item()}"


@pytest.fixture(autouse=True)
def both_cpu_plans(kernel_cache):
    """bf16: native with GEMM attention; fp16: hybrid (matmuls native, attention emulated). The emulated
    region is the policies' kernels=emulated."""
    kernel_cache(torch.bfloat16, attention="gemm")
    kernel_cache(torch.float16, attention="emulated")


POLICIES = [
    "mixed_bf16",
    "mixed_fp16",
    "o2_bf16",
    "o2_fp16",
    "pure_bf16",
    "base=mixed_bf16,kernels=emulated",
    "base=mixed_fp16,kernels=emulated",
    "base=mixed_fp16,kernels=emulated,fp32_ops=gelu",
    "base=mixed_bf16,fp32_ops=gelu",
    "base=mixed_bf16,fp32_modules=Linear",
    "base=mixed_fp16,kernels=emulated,fp32_modules=Block",
    "base=mixed_bf16,fp32_modules=Stage",  # the checkpoints are called inside an FP32 module's forward
    "base=mixed_fp16,kernels=emulated,fp32_modules=Stage",
    "base=mixed_fp16,kernels=emulated,bf16_names=stage",  # the checkpoints are called inside a bf16 module's forward
    "base=mixed_fp16,bf16_names=stage.blocks.1",  # one checkpointed block in bf16 (native), the others fp16 (hybrid)
    "base=mixed_fp16,kernels=emulated,bf16_names=stage,fp32_names=stage.blocks.2",  # FP32 inside bf16
    "base=mixed_fp16,kernels=native,bf16_names=stage.blocks.1",  # autocast alone, fp16 around bf16
    # an emulated bf16 layer inside a checkpointed block: its emulation, entered in the forward and the recompute,
    # saved 16-bit copies past the checkpoint's hooks (CheckpointError)
    "base=mixed_fp16,kernels=emulated,bf16_names=stage.blocks.1.up",
]


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_with_checkpointing_equal_those_without(policy, device):
    if "fp16" in policy and not mixprec.device_caps(device).supports_fp16:
        pytest.skip(f"{device} computes no fp16")
    _assert_equal(_gradients(policy, device, False), _gradients(policy, device, True))


def test_a_selective_checkpoint_context_of_ones_own_is_kept(device):
    # PyTorch's selective checkpointing: matmul outputs saved, the rest recomputed, in the region
    save_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    policy = "base=mixed_fp16,kernels=emulated"
    _assert_equal(_gradients(policy, device, False), _gradients(policy, device, True, context_fn=save_matmuls))


# what of each region (POLICIES, in order) a recompute by torch's own checkpoint would lack, found first;
# None: nothing (inside an FP32 module, torch restores autocast switched off, and the emulation is suspended)
MISSING = [
    "bf16 GEMM attention",
    "the 16-bit emulation's roundings",  # hybrid: attention emulated
    "bf16 GEMM attention",
    "the 16-bit emulation's roundings",
    "bf16 GEMM attention",
    "the 16-bit emulation's roundings",
    "the 16-bit emulation's roundings",
    "the 16-bit emulation's roundings",
    "bf16 GEMM attention",  # before the FP32 op gelu
    "the policy's FP32 module Linear",
    "the policy's FP32 module Block",
    None,
    None,
    "the 16-bit emulation's roundings",
    "the 16-bit emulation's roundings",
    "the 16-bit emulation's roundings",
    "the policy's bf16 module Block",  # torch's recompute would run it in fp16
    "the 16-bit emulation's roundings",
]
# on CUDA mixed, O2 and pure bf16/fp16 regions are torch.autocast on PyTorch's own kernels (no GEMM attention, no
# hybrid emulation), which torch's checkpoint restores: nothing is missing, and the gradients are equal
MISSING_ON_CUDA = {policy: None for policy in ("mixed_bf16", "mixed_fp16", "o2_bf16", "o2_fp16", "pure_bf16")}
MISSING_ON_CUDA["base=mixed_bf16,fp32_ops=gelu"] = "the policy's FP32 op gelu"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize(("policy", "missing"), list(zip(POLICIES, MISSING, strict=True)))
def test_torchs_own_checkpoint_inside_a_region_is_refused_where_it_would_differ(policy, missing, reentrant, device):
    # its recompute runs after the region exited: under emulated fp16 with fp32_ops=gelu the gradients of a
    # 2-layer MLP differed silently, by 1.0 at the default loss scale; reentrant, under GEMM attention, by 0.66%
    if "fp16" in policy and not mixprec.device_caps(device).supports_fp16:
        pytest.skip(f"{device} computes no fp16")
    options = {"via": torch_checkpoint, "use_reentrant": reentrant}
    if torch.device(device).type == "cuda":
        missing = MISSING_ON_CUDA.get(policy, missing)
    if missing is None:
        _assert_equal(_gradients(policy, device, False), _gradients(policy, device, True, **options))
        return
    call = r"torch.utils.checkpoint\(..., use_reentrant=True\)" if reentrant else r"torch.utils.checkpoint"
    with pytest.raises(ValueError, match=rf"{call} was called inside a mixprec region.* without {missing}"):
        _gradients(policy, device, True, **options)


@pytest.mark.parametrize(
    "policy", ["base=mixed_fp16,kernels=emulated,fp32_ops=gelu", "base=mixed_bf16,fp32_modules=Stage"]
)
def test_torchs_checkpoint_with_the_regions_context_recomputes_in_it(policy, device):
    if "fp16" in policy and not mixprec.device_caps(device).supports_fp16:
        pytest.skip(f"{device} computes no fp16")
    expected = _gradients(policy, device, False)
    got = _gradients(
        policy, device, True, via=torch_checkpoint, use_reentrant=False, context_fn=mixprec.recompute_context
    )
    _assert_equal(expected, got)


def test_torchs_checkpoint_where_the_region_is_autocast_alone_is_left_alone(device, kernel_cache):
    # a region of torch.autocast only (native bf16, attention on PyTorch's kernel): torch restores it
    kernel_cache(torch.bfloat16, attention="native")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    x = torch.randn(4, 16, device=device)
    grads = []
    for checkpointed in (False, True):
        with mixprec.autocast("mixed_bf16", mlp):
            y = torch_checkpoint(mlp, x, use_reentrant=False) if checkpointed else mlp(x)
        grads.append(torch.autograd.grad(y.float().pow(2).sum(), list(mlp.parameters())))
    _assert_equal(list(grads[0]), list(grads[1]))


def test_outside_a_region_it_is_torchs_checkpoint(device):
    torch.manual_seed(0)
    block, x = Block().to(device), torch.randn(2, 5, 16, device=device)
    torch.manual_seed(1)
    expected = torch.autograd.grad(block(x).sum(), list(block.parameters()))
    torch.manual_seed(1)
    got = torch.autograd.grad(mixprec.checkpoint(block, x).sum(), list(block.parameters()))
    _assert_equal(list(expected), list(got))


@pytest.mark.parametrize(
    "policy",
    [
        "base=mixed_fp16,kernels=emulated",
        "base=mixed_fp16,kernels=emulated,fp32_modules=Stage",
        "base=mixed_fp16,kernels=emulated,bf16_names=stage",
        "base=mixed_bf16,kernels=emulated",
    ],
)
def test_backward_inside_the_region_recomputes_in_it(policy, device):
    # the region is still entered when backward runs: the recompute enters it again, as a recompute's (the
    # checkpoint, not the emulation, saves); recomputed in the emulation's own entry it raised CheckpointError
    expected = _gradients(policy, device, False)
    torch.manual_seed(0)
    model = Net(True).to(device)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy)
    x = torch.randn(4, 6, 16, device=device)
    with mp.autocast():
        mp.backward(model(x).float().pow(2).mean())
    _assert_equal(expected, [p.grad for p in model.parameters()])


def test_the_reentrant_checkpoint_and_fp8_are_refused():
    block = Block()
    with pytest.raises(ValueError, match=r"use_reentrant=True.* takes no context_fn.* Use use_reentrant=False"):
        mixprec.checkpoint(block, torch.randn(2, 5, 16), use_reentrant=True)
    model = Net(True)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "base=mixed_bf16,fp8=hybrid")
    with (
        pytest.raises(ValueError, match=r"FP8 layers record each tensor's amax .* without checkpointing"),
        mp.autocast(),
    ):
        model(torch.randn(4, 6, 16))
    model = Net(True, via=torch_checkpoint, use_reentrant=False)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "base=mixed_bf16,fp8=hybrid")
    with pytest.raises(ValueError, match=r"without the policy's FP8 GEMM layers"), mp.autocast():
        model(torch.randn(4, 6, 16))


transformers = pytest.importorskip("transformers")


def _bert(checkpointing: dict | None) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model


def _bert_gradients(policy: str, model: nn.Module, enable_after: dict | None = None) -> list[torch.Tensor]:
    optimizer = (mixprec.AdamW if "pure" in policy else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    if enable_after is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=enable_after)
    model.train()  # dropout on: the recompute replays the forward's random state
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(3))
    with mp.autocast():
        loss = model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss
    mp.backward(loss)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable's rename
@pytest.mark.parametrize("policy", ["mixed_bf16", "base=mixed_fp16,kernels=emulated", "o2_bf16", "pure_bf16"])
def test_a_hugging_face_model_with_checkpointing_on_recomputes_in_the_region(policy):
    expected = _bert_gradients(policy, _bert(None))
    _assert_equal(expected, _bert_gradients(policy, _bert({"use_reentrant": False})))
    _assert_equal(expected, _bert_gradients(policy, _bert(None), enable_after={"use_reentrant": False}))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_hugging_face_model_checkpointing_reentrantly_is_refused():
    model = _bert({"use_reentrant": True})
    with pytest.raises(ValueError, match=r"use_reentrant=True, which recomputes outside the policy's region"):
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "mixed_bf16")


@pytest.mark.parametrize("via", [mixprec.checkpoint, functools.partial(torch_checkpoint, use_reentrant=False)])
def test_a_region_entered_inside_the_checkpointed_block_is_recomputed_with_it(via, device):
    # the checkpoint began outside any region: its recompute runs the block, which enters the region again
    policy = "base=mixed_bf16,fp32_ops=gelu,names=2"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device)
    x = torch.randn(4, 16, device=device)

    def block(inputs: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast(policy, model):
            return model(inputs)

    grads = []
    for checkpointed in (False, True):
        loss = (via(block, x) if checkpointed else block(x)).float().pow(2).sum()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    _assert_equal(list(grads[0]), list(grads[1]))


def test_torchs_checkpoint_nested_inside_mixprecs_is_refused():
    # mixprec's recompute re-enters the region, but the inner torch checkpoint's own recompute would not:
    # under emulated fp16 with fp32_ops=gelu the gradients were silently 0.016 off
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    with (
        pytest.raises(ValueError, match=r"torch.utils.checkpoint was called inside a mixprec region"),
        mixprec.autocast("base=mixed_fp16,kernels=emulated,fp32_ops=gelu", inner),
    ):
        mixprec.checkpoint(lambda t: torch_checkpoint(inner, t, use_reentrant=False), torch.randn(4, 16))


def test_a_refusal_or_an_error_inside_a_checkpoint_leaves_no_hook_behind(device):
    # torch 2.12 and older leave a checkpoint's saved-tensor hook pushed when its function raises; on torch 2.11
    # a refusal then left the emulation's hook on outside any region, and every later CUDA checkpoint test failed
    policy = mixprec.get_policy("mixed_fp16").replace(kernels="emulated", fp32_ops=("gelu",))
    block, x = Block().to(device), torch.randn(2, 5, 16, device=device, requires_grad=True)
    kept = []  # the exceptions stay alive, as in a notebook's last traceback

    def boom(t: torch.Tensor) -> torch.Tensor:
        raise KeyError("an error of the user's")

    for call, error in ((lambda: torch_checkpoint(block, x, use_reentrant=False), ValueError),
                        (lambda: mixprec.checkpoint(boom, x), KeyError)):  # fmt: skip
        with pytest.raises(error) as caught, mixprec.autocast(policy, block):
            call()
        kept.append(caught.value)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    torch.manual_seed(1)
    expected = torch.autograd.grad(block(x).sum(), list(block.parameters()))
    torch.manual_seed(1)
    _assert_equal(list(expected), list(torch.autograd.grad(torch_checkpoint(block, x, use_reentrant=False).sum(),
                                                           list(block.parameters()))))  # fmt: skip


@pytest.mark.parametrize("policy", ["mixed_bf16", "base=mixed_fp16,kernels=emulated,fp32_modules=Block"])
def test_a_graph_kept_for_a_second_backward_recomputes_at_each(policy, device):
    # torch enters a checkpoint's recompute context once per recompute: a one-shot context raised AttributeError
    if "fp16" in policy and not mixprec.device_caps(device).supports_fp16:
        pytest.skip(f"{device} computes no fp16")
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Net(checkpointed).to(device)
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy)
        with mp.autocast():
            loss = model(torch.randn(4, 6, 16, device=device)).float().pow(2).mean()
        mp.backward(loss, retain_graph=True)
        mp.backward(loss)
        grads.append([p.grad for p in model.parameters()])
    _assert_equal(*grads)


class _AttentionThenMlp(nn.Module):
    """Attention outside the checkpoint, an MLP inside it (recomputed in full: ``early_stop=False``)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.qkv, self.checkpointed = nn.Linear(16, 48), checkpointed
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        return mixprec.checkpoint(self.mlp, x, early_stop=False) if self.checkpointed else self.mlp(x)


def test_a_recompute_inside_the_engines_region_leaves_its_attention_watched(device):
    # the recompute's entry, which saw the MLP alone, recorded "no attention" for the engine's region: from the
    # second step its attention ran on torch's kernel, not the GEMM attention the probe chose
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = _AttentionThenMlp(checkpointed).to(device)
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "mixed_bf16")
        for _ in range(2):
            model.zero_grad()
            with mp.autocast():
                mp.backward(model(torch.randn(4, 6, 16, device=device)).float().pow(2).mean())  # inside the region
        grads.append([p.grad for p in model.parameters()])  # the second step's
    _assert_equal(*grads)
