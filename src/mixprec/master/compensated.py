"""AdamW for low-precision parameters without an FP32 master copy: compensated updates.

A bf16 weight near 1.0 moves in steps of 2**-8; an update of 1e-4 is rounded away entirely. Storing an
FP32 master copy fixes that at 4 extra bytes per parameter. This optimizer keeps parameters and the first
moment in the parameters' dtype, the second moment in FP32, and computes each step in FP32, then writes the new
weight back with:

    kahan       (default) a bf16 compensation buffer carries what rounding lost into the next step:
                    w = p + c (in FP32);  w = adamw(w);  p' = round(w);  c = w - p'
                2 extra bytes per parameter; tiny updates accumulate until they move the weight.
    stochastic  p' = stochastic_round(p + update): unbiased on average, no extra memory.
    nearest     plain rounding (what a bf16 torch optimizer does); for comparison.

Skipping on the device: like torch's fused optimizers, the optimizer takes ``found_inf`` (and
``grad_scale``) as attributes set just before ``step()`` (``_step_supports_amp_scaling``), as
``MixedPrecision`` and ``torch.amp.GradScaler`` do; the fused kernel then leaves parameters, moments,
compensation and step counts as they were when ``found_inf`` is nonzero, with no host sync. FP32
parameters and the CPU single-pass kernel read the flag on the host instead (free on the CPU).

The second moment is FP32 because in bf16 it cannot decay: with beta2 = 0.999 an update changes it by 0.1%,
under half a bf16 unit (0.39%), so it rounds back to itself; it only grows, on a large gradient, and the step size
shrinks for good (measured before 2026-11-28: after 100 steps of gradient 1 and 4,900 of 0.01, the second moment
held 0.098 against FP32's 0.0008 and the weight had moved a third as far; on steady N(0, 1) gradients it crept to
1.72 instead of 1.00 over 6,000 steps). ``nearest`` keeps it in the parameters' dtype, as a bf16 torch optimizer
does. The first moment (beta1 = 0.9: 10% a step) decays in bf16.

Model state with bf16 parameters: 2 (param) + 2 (grad) + 2 (first moment) + 4 (second) + 2 (kahan) = 12
bytes/param, against 16 for FP32 AdamW. For FP32 parameters every mode is plain AdamW and follows
``torch.optim.AdamW``'s arithmetic op for op.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    >>> opt = AdamW([p], lr=1e-4)
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.checks import flag, shown
from mixprec.compute.compile_guard import compile_blocked
from mixprec.distributed.ranks import local
from mixprec.master.single_pass import kahan_adamw_kernel, run_kahan_adamw, run_kahan_adamw_group, why_unavailable
from mixprec.numerics.quantize import quantize

__all__ = [
    "UPDATE_MODES",
    "AdamW",
    "fingerprint",
    "remember_rounding_residual",
    "rounding_residual",
    "take_rounding_residuals",
]

UPDATE_MODES = ("kahan", "stochastic", "nearest")

# What casting a parameter to 16 bits lost, where the cast happens before MixedPrecision sees the model
# (mixprec.fully_shard under pure_bf16), until MixedPrecision hands it to the optimizer (AdamW.start_from).
# Kept by module and parameter name: frameworks swap parameter objects afterwards (Lightning's .to()), and a
# weak reference to a parameter would stop torch.utils.swap_tensors.
_RESIDUALS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[torch.Tensor, tuple[int, int]]]] = (
    weakref.WeakKeyDictionary()
)


def rounding_residual(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What casting the FP32 ``param`` to ``dtype`` loses (``exact - rounded``), in ``dtype``: 2 bytes each."""
    return (param.detach() - param.detach().to(dtype).float()).to(dtype)


def remember_rounding_residual(module: torch.nn.Module, name: str, residual: torch.Tensor) -> None:
    """Keep ``exact - param`` of ``module``'s parameter ``name`` (in the parameter's dtype and layout)."""
    _RESIDUALS.setdefault(module, {})[name] = (residual, fingerprint(getattr(module, name)))


def take_rounding_residuals(model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """The remembered residuals of ``model``'s parameters, by parameter, forgotten here (handed over once);
    one whose parameter was written since (weights loaded after sharding) or moved is dropped."""
    taken = {}
    for module in model.modules():
        for name, (residual, then) in _RESIDUALS.pop(module, {}).items():
            param = module._parameters.get(name)
            fits = param is not None and (residual.shape, residual.dtype) == (param.shape, param.dtype)
            moved = not fits or residual.device != param.device or type(residual) is not type(param.data)
            if not moved and fingerprint(param) == then:
                taken[param] = residual
    return taken


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with compensated updates for bf16/fp16 parameters.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        update: ``"kahan"``, ``"stochastic"`` or ``"nearest"``; see the module docstring.
        generator: random source for stochastic updates.
        single_pass: for ``kahan``, run the step as compiled kernels reading and writing each element once
            (:mod:`mixprec.master.single_pass`: on CPUs one kernel per parameter, on CUDA one compiled graph
            per group); None (default): where a compiler is present (C++; Triton).
    """

    _step_supports_amp_scaling = True  # step() honours found_inf / grad_scale (see the module docstring)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        update: str = "kahan",
        generator: torch.Generator | None = None,
        single_pass: bool | None = None,
    ) -> None:
        # each group's values, these defaults included, are checked as the group is added (add_param_group)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "update": update})
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"AdamW(generator=...) takes a torch.Generator or None; received {generator!r}.")
        if single_pass is not None:
            flag(single_pass, "AdamW(single_pass=...) (or None: the compiled kernel where it runs)")
        self._generator = generator
        self._single_pass = single_pass
        # start_from's residuals, by id(param): (residual, the parameter's fingerprint when it was given)
        self._starts: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, keeping the FP32 second moment of a 16-bit parameter FP32 (torch casts every state tensor to
        its parameter's dtype; one saved in bf16 by an earlier release is widened, exactly). A start_from residual
        of a parameter whose state is loaded is dropped: it is for a first step, which that parameter is past.
        Each saved group's hyper-parameters are checked as the constructor's are; a key the state lacks (a torch
        optimizer's has no ``update``) takes this optimizer's default."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError(
                f"AdamW.load_state_dict(state_dict=...) needs what an optimizer's state_dict() returned (keys "
                f"'state' and 'param_groups'); received {shown(state_dict)}."
            )
        for saved in state_dict["param_groups"]:
            _check_hyperparameters({**self.defaults, **saved})
        super().load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for param, saved_id in zip(group["params"], saved["params"], strict=True):  # torch pairs them so
                state = self.state.get(param)
                if not state:
                    continue
                self._starts.pop(id(param), None)
                value = state_dict["state"].get(saved_id, {}).get("exp_avg_sq")
                if value is not None and _wide_second_moment(param, group):
                    state["exp_avg_sq"] = value.to(device=param.device, dtype=torch.float32, copy=True)
                # a state from another update mode, or a torch AdamW's: no compensation yet
                if group["update"] == "kahan" and param.dtype.itemsize < 4 and "kahan_comp" not in state:
                    state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking the group's hyper-parameters (its own, else the defaults)."""
        _check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def start_from(self, residuals: dict[torch.Tensor, torch.Tensor]) -> int:
        """Begin kahan-updated parameters at the exact FP32 values they were rounded from: ``residuals`` maps
        a parameter, rounded to 16 bits, to what the rounding lost (``exact - rounded``, in the parameter's
        dtype), which becomes its compensation at its first step, so ``p + c`` starts at the exact value to
        16 significant bits instead of 8 (a pretrained FP32 checkpoint fine-tuned in bf16 keeps its weights).

        Nothing is added to the optimizer's state until then (a state loaded by ``load_state_dict`` or
        torch.distributed.checkpoint replaces it as before). A parameter written after this call (weights
        loaded into the model: ``load_state_dict`` copies in place) starts at 0, as its residual no longer
        describes it; so do frozen parameters, other update modes and parameters that already stepped.
        Returns how many parameters will start from their residual."""
        kahan = {id(p) for group in self.param_groups if group["update"] == "kahan" for p in group["params"]}
        for param, residual in residuals.items():
            wanted = id(param) in kahan and param.requires_grad and not self.state.get(param)
            if wanted and residual.dtype == param.dtype != torch.float32:
                self._starts[id(param)] = (residual, fingerprint(param))
        return len(self._starts)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # set by MixedPrecision or GradScaler just before step(); absent otherwise
        scaling = _AmpScaling(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("mixprec.AdamW does not support sparse gradients.")
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for param in params:
                by_dtype.setdefault(param.dtype, []).append(param)
            for same_dtype in by_dtype.values():
                self._update(same_dtype, group, scaling)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict[str, Any], scaling: _AmpScaling) -> None:
        """One AdamW step for parameters of one dtype."""
        lowp = params[0].dtype.itemsize < 4  # 16 bits; FP32 and float64 step as torch.optim.AdamW does
        kahan = lowp and group["update"] == "kahan"
        on_device = lowp and not (kahan and self._single_pass_runs(params))  # the fused kernel takes the flag
        if not on_device and scaling.skip_on_host():
            return
        for param in params:
            state = self.state[param]
            if not state:
                residual, taken = self._starts.pop(id(param), (None, None))
                state.update(_first_state(param, lowp, kahan, wide_second_moment=_wide_second_moment(param, group)))
                if kahan and residual is not None and taken == fingerprint(param):  # not loaded over since
                    state["kahan_comp"] = residual
            elif lowp and state["step"].device != param.device:
                state["step"] = state["step"].to(param.device)  # the fused kernel reads it on the device
        states = [self.state[p] for p in params]
        steps = [state["step"] for state in states]
        if kahan and self._group_kernel_runs(params):  # CUDA: one compiled graph, the skip on the device
            arguments = scaling.kernel_arguments(params[0].device)
            compensations = [local(s["kahan_comp"]) for s in states]
            tensors = _shards(params, states)
            tensors = (tensors[0], compensations, *tensors[1:])
            grad_scale, found_inf = arguments.get("grad_scale"), arguments.get("found_inf")
            if run_kahan_adamw_group(kahan_adamw_kernel("cuda"), tensors, steps, group, grad_scale, found_inf):
                return
            self._kernel_available("cuda")  # failed to compile, single_pass=True: refused, naming why
        if kahan and on_device:
            # The eager Kahan path re-rounds p + c, which on a skipped step could move a weight whose compensation
            # is exactly half a unit (871 of 2**20 by one unit, measured): the flag is read on the host here
            # (a sync, on this fallback path only: a group with a strided tensor, or no Triton).
            if scaling.skip_on_host():
                return
            scaling = _AmpScaling(scaling.grad_scale, None)  # the fused kernel below still unscales
        torch._foreach_add_(steps, 1.0)  # one launch, not one per parameter
        if not on_device:  # found_inf was read above; unscale here, the kernels below do not
            scaling.unscale([local(p.grad) for p in params])
            if not lowp:
                self._update_fp32(params, states, group)
                return
            if self._run_single_pass(*_shards(params, states), states, group):
                return
            scaling = _AmpScaling(None, None)  # a tensor the CPU kernel cannot take: the eager path, settled
        for chunk in _chunks(list(zip(params, states, strict=True))):
            self._update_low_precision([p for p, _ in chunk], [s for _, s in chunk], group, scaling)
        if scaling.found_inf is not None:  # a skipped step does not count, as in torch's fused AdamW
            torch._foreach_sub_(steps, [scaling.found_inf.to(steps[0].device).reshape(())] * len(steps))

    def _update_fp32(self, params: list[torch.Tensor], states: list[dict[str, Any]], group: dict[str, Any]) -> None:
        """FP32 parameters: torch.optim.AdamW's single-tensor arithmetic, op for op, in foreach kernels."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        # Parameters added together share a step count; a group's steps can differ only if some
        # parameters had no gradient at some step, so compute the bias corrections per step value.
        steps = [s["step"].item() for s in states]  # host values, as torch.optim.AdamW (CPU tensors)
        params, grads, exp_avgs, exp_avg_sqs = _shards(params, states)
        torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias_correction2_sqrt = [(1 - beta2**step) ** 0.5 for step in steps]
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, eps)
        step_sizes = [-lr / (1 - beta1**step) for step in steps]
        torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)

    def _update_low_precision(
        self, params: list[torch.Tensor], states: list[dict[str, Any]], group: dict[str, Any], scaling: _AmpScaling
    ) -> None:
        """16-bit parameters: torch's fused AdamW kernel computes the step in FP32.

        ``nearest`` runs it on the 16-bit tensors directly (one pass, rounding each result). The
        compensated modes widen one chunk of parameters to FP32 (for kahan, parameter + compensation:
        the value the weights would hold with an FP32 master), step it, and round it back; a chunk at
        a time bounds the transient FP32 memory.
        """
        update = group["update"]
        hyper = {
            "lr": group["lr"],
            "beta1": group["betas"][0],
            "beta2": group["betas"][1],
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
            "amsgrad": False,
            "maximize": False,
            **scaling.kernel_arguments(params[0].device),
        }
        steps = [s["step"] for s in states]
        params, grads, exp_avgs, exp_avg_sqs = _shards(params, states)
        if update == "nearest":
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, **hyper)
            return
        wide = [[t.float() for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs)]
        weights, wide_grads, wide_avgs, wide_avg_sqs = wide
        if update == "kahan":
            compensations = [local(s["kahan_comp"]) for s in states]
            torch._foreach_add_(weights, compensations)
        torch._fused_adamw_(weights, wide_grads, wide_avgs, wide_avg_sqs, [], steps, **hyper)
        torch._foreach_copy_(exp_avgs, wide_avgs)
        if exp_avg_sqs[0].dtype != torch.float32:  # else widened in place
            torch._foreach_copy_(exp_avg_sqs, wide_avg_sqs)
        if update == "kahan":
            torch._foreach_copy_(params, weights)  # rounded to the parameters' dtype
            torch._foreach_sub_(weights, params)  # what the rounding lost, carried to the next step
            torch._foreach_copy_(compensations, weights)
        else:
            for param, target in zip(params, weights, strict=True):
                param.copy_(quantize(target, param.dtype, rounding="stochastic", generator=self._generator))

    def _single_pass_runs(self, params: list[torch.Tensor]) -> bool:
        """Whether the Kahan step runs as the compiled CPU kernel (one pass per parameter)."""
        return params[0].device.type == "cpu" and self._kernel_available("cpu")

    def _group_kernel_runs(self, params: list[torch.Tensor]) -> bool:
        """Whether the Kahan step runs as the compiled CUDA graph over the whole group (a group with a strided
        tensor takes the eager path: :func:`run_kahan_adamw_group` says so, having changed nothing)."""
        return params[0].device.type == "cuda" and self._kernel_available("cuda")

    def _kernel_available(self, device_type: str) -> bool:
        """Whether the compiled kernel for ``device_type`` runs; single_pass=True refuses where it cannot."""
        if self._single_pass is False or compile_blocked():  # under a dispatch mode: eager, compiled at the next
            return False
        if kahan_adamw_kernel(device_type) is None:
            if self._single_pass:
                raise RuntimeError(
                    "AdamW(single_pass=True): the compiled kernel is unavailable here "
                    f"({why_unavailable(device_type)}); use single_pass=None to take the eager path where it is."
                )
            return False
        return True

    def _run_single_pass(self, params, grads, exp_avgs, exp_avg_sqs, states, group) -> bool:
        """The Kahan step in one compiled pass per parameter, on CPUs; False (nothing changed) where a
        tensor is not contiguous."""
        compensations = [local(s["kahan_comp"]) for s in states]
        steps = [s["step"].item() for s in states]  # CPU tensors: a memory read
        tensors = (params, compensations, grads, exp_avgs, exp_avg_sqs)
        return run_kahan_adamw(kahan_adamw_kernel(), tensors, steps, group)


def _check_hyperparameters(group: dict[str, Any]) -> None:
    """A clear error for a value AdamW cannot use, given to the constructor or in a param group (a typo in a
    group's ``update`` was taken as stochastic rounding before 2026-11-28)."""
    where = "(the constructor's argument, or a param group's key)"
    for key in ("lr", "eps", "weight_decay"):
        value = group[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()  # a tensor learning rate, as torch's optimizers take
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
            raise ValueError(f"AdamW: {key} must be a finite number >= 0; received {group[key]!r} {where}.")
    betas = group["betas"]
    if isinstance(betas, (tuple, list)):  # tensor betas, as torch's optimizers take
        betas = [b.item() if isinstance(b, torch.Tensor) and b.numel() == 1 else b for b in betas]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(isinstance(b, (int, float)) for b in betas)):
        raise ValueError(f"AdamW: betas must be two numbers (beta1, beta2); received {betas!r} {where}.")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"AdamW: betas must lie in [0, 1); received {betas!r} {where}.")
    if group["update"] not in UPDATE_MODES:
        raise ValueError(
            f"AdamW: update must be one of {', '.join(map(repr, UPDATE_MODES))}; received {group['update']!r} {where}."
        )


class _AmpScaling:
    """``grad_scale`` and ``found_inf`` as GradScaler's protocol hands them to an optimizer (either None)."""

    def __init__(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        self.grad_scale, self.found_inf = grad_scale, found_inf

    def skip_on_host(self) -> bool:
        """Whether ``found_inf`` says skip, read on the host (a sync on accelerators; free on the CPU)."""
        return self.found_inf is not None and bool(self.found_inf.item())

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Divide the gradients by ``grad_scale`` in place, for the paths whose kernel does not take it."""
        if self.grad_scale is not None:
            torch._foreach_div_(grads, self.grad_scale.to(grads[0].device))

    def kernel_arguments(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``grad_scale=`` / ``found_inf=`` for torch's fused AdamW kernel, on the parameters' device."""
        given = {"grad_scale": self.grad_scale, "found_inf": self.found_inf}
        return {name: value.to(device).reshape(()) for name, value in given.items() if value is not None}


def fingerprint(param: torch.Tensor) -> tuple[int, int]:
    """Two exact integer sums over the bits of ``param``'s 16-bit values (its local shard's): whether the
    weights were written since a residual was taken (``load_state_dict`` and FSDP2's loads copy in place,
    and a DTensor's version counter does not count them)."""
    bits = local(param.detach()).reshape(-1).view(torch.int16).to(torch.int64)
    return int(bits.sum()), int((bits * bits).sum())


def _wide_second_moment(param: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether ``param``'s second moment is kept in FP32: a 16-bit parameter, not updated ``nearest``."""
    return param.dtype.itemsize < 4 and group["update"] != "nearest"


def _first_state(param: torch.Tensor, lowp: bool, kahan: bool, wide_second_moment: bool) -> dict[str, torch.Tensor]:
    """A parameter's state before its first step: step 0, zero moments (and compensation, for kahan); the second
    moment in FP32 where ``wide_second_moment`` (see the module docstring)."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=param.device if lowp else "cpu")}
    for name in ("exp_avg", "exp_avg_sq", "kahan_comp")[: 3 if kahan else 2]:
        dtype = torch.float32 if name == "exp_avg_sq" and wide_second_moment else None
        state[name] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    return state


def _shards(params: list[torch.Tensor], states: list[dict[str, Any]]) -> tuple[list[torch.Tensor], ...]:
    """Parameters, gradients and both moments as this rank's tensors (an FSDP2 DTensor's local shard)."""
    return (
        [local(p) for p in params],
        [local(p.grad) for p in params],
        [local(s["exp_avg"]) for s in states],
        [local(s["exp_avg_sq"]) for s in states],
    )


# Elements widened to FP32 at once by the compensated modes: 4 tensors x 4 bytes x 2**22 = 64 MiB.
CHUNK_ELEMENTS = 2**22


def _chunks(items: list[tuple[torch.Tensor, Any]]) -> list[list[tuple[torch.Tensor, Any]]]:
    """Consecutive runs of parameters holding about CHUNK_ELEMENTS elements (a larger one alone)."""
    chunks: list[list[tuple[torch.Tensor, Any]]] = [[]]
    size = 0
    for item in items:
        if chunks[-1] and size + item[0].numel() > CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += item[0].numel()
    return chunks
