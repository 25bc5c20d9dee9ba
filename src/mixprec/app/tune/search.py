"""``mixprec tune``: the fastest per-layer precision that keeps the accuracy, found by cost model and trials.

    1. shapes and allowed formats of every GEMM layer (:mod:`mixprec.app.tune.layers`: the doctor's statistics)
    2. the cost of each layer in each format (:mod:`mixprec.app.tune.cost`: measured here, or a device profile)
    3. trials: short runs from the same seed and data under the uniform base policy, FP32, and each candidate
       (emulated exactly where the device lacks a format: a CPU tunes for a GPU); a candidate's loss change is
       its validation loss against the uniform base's
    4. greedy, in sensitivity order (the doctor's FP8 error, smallest first): each layer that the cost model
       says runs faster in FP8 is tried in FP8 on top of those accepted so far, kept when the loss change stays
       within the tolerance; a layer the cost model finds faster in FP32 than in 16 bits takes FP32 at no risk
       to the loss; layers the doctor keeps out of the base's 16 bits stay out (in FP32, or in bf16 in an fp16
       base, whichever the cost model finds faster)
    5. verification: the chosen policy, the uniform base and FP32, each over ``seeds`` seeds, longer runs; with the
       cost model measured here, a uniform policy whose step measured 5% faster than the chosen one's, its loss
       within the tolerance, replaces it (the cost model counts layers, not a 16-bit base's casts around them)

Every trial prints a progress line; a budget stops the greedy search early (the verification still runs).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mixprec.app.config import TrainConfig
from mixprec.app.tune.cost import (
    ATTENTION_OP,
    BF16,
    FORMATS,
    DeviceProfile,
    LayerShape,
    Prediction,
    measure_profile,
    predict,
)
from mixprec.app.tune.layers import ATTENTION, LayerChoice
from mixprec.app.tune.names import compact_names

__all__ = ["Candidate", "NoFiniteReference", "TuneOptions", "assignment_policy", "pareto_front", "search"]


class NoFiniteReference(ValueError):
    """Neither the uniform base nor FP32 kept the loss finite: there is no loss for a policy to hold (a finding
    about the model: ``mixprec tune`` exits 1, as the doctor does for a model that makes inf/NaN in FP32)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} made inf or NaN under the uniform base and in FP32: there is no loss for a policy to keep, so "
            "none was chosen or written. mixprec doctor TASK names the first module, phase and kind of the first "
            "inf or NaN."
        )


@dataclass(frozen=True)
class TuneOptions:
    """How to search: the base 16-bit preset, the accuracy tolerance, the run lengths, the time budget."""

    base: str = "mixed_bf16"
    tolerance: float = 0.005  # relative validation-loss change allowed against the uniform base
    trial_steps: int = 60
    verify_steps: int = 180
    seeds: int = 3
    budget_minutes: float | None = None


@dataclass
class Candidate:
    """One per-layer policy tried: its layers' formats, the prediction, and the trial's loss change."""

    policy: str
    assignment: dict[str, str]
    prediction: dict[str, Any]
    loss: float
    loss_change: float  # relative, against the uniform base's trial loss
    accepted: bool
    note: str = ""


def assignment_policy(base: str, assignment: dict[str, str], modules: Sequence[str] = ()) -> str:
    """The policy string of a per-layer assignment: FP32 layers as ``names=``, bf16 layers (an fp16 base) as
    ``bf16_names=``, FP32 attention as ``ops=scaled_dot_product_attention``, FP8 layers as ``fp8=(only=...)``; given
    the model's ``modules`` (every name), the names of one layer across blocks as a glob where it names those layers
    exactly (:func:`~mixprec.app.tune.names.compact_names`)."""
    fp32 = compact_names((name for name, fmt in assignment.items() if fmt == "fp32" and name != ATTENTION), modules)
    bf16 = compact_names((name for name, fmt in assignment.items() if fmt == BF16), modules)
    fp8 = compact_names((name for name, fmt in assignment.items() if fmt == "fp8"), modules)
    parts = [f"base={base}"]
    if fp32:
        parts.append("names=" + "+".join(fp32))
    if bf16:
        parts.append("bf16_names=" + "+".join(bf16))
    if assignment.get(ATTENTION) == "fp32":
        parts.append(f"ops={ATTENTION_OP}")
    if fp8:
        parts.append("fp8=hybrid(scaling=current,keep=none,only=" + "+".join(fp8) + ",shapes=all)")
    return ",".join(parts)


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other beats on both predicted speed-up (higher) and loss change (lower)."""
    finite = [c for c in candidates if math.isfinite(c.loss_change)]

    def beaten(c: Candidate) -> bool:
        s, d = c.prediction["speedup"], c.loss_change
        return any(
            o is not c and o.prediction["speedup"] >= s and o.loss_change <= d
            and (o.prediction["speedup"] > s or o.loss_change < d)
            for o in finite
        )  # fmt: skip

    return sorted((c for c in finite if not beaten(c)), key=lambda c: c.prediction["speedup"])


@dataclass
class SearchState:
    """What the search has measured so far."""

    config: TrainConfig
    options: TuneOptions
    choices: dict[str, LayerChoice]
    profile: DeviceProfile
    base_step_ms: float | None
    progress: Callable[[str], None]
    modules: tuple[str, ...] = ()  # every module name of the model: what a glob in a policy may match
    started: float = field(default_factory=time.monotonic)
    candidates: list[Candidate] = field(default_factory=list)
    not_tried: dict[str, str] = field(default_factory=dict)  # layer -> why FP8 was not tried on it
    seconds_per_step: float = 0.0  # the slowest run's so far, set-up included: what the budget plans with

    def shapes(self) -> dict[str, LayerShape]:
        return {name: choice.shape for name, choice in self.choices.items()}

    def predict(self, assignment: dict[str, str]) -> Prediction:
        return predict(assignment, self.shapes(), self.profile, self.base_step_ms)

    def trial(self, policy: str, seed: int | None = None, steps: int | None = None) -> tuple[float, float]:
        """(validation loss, ms per step) of a short run under ``policy``."""
        start, steps = time.monotonic(), steps or self.options.trial_steps
        loss, ms = run_trial(self.config, policy, seed if seed is not None else self.config.seed, steps)
        self.seconds_per_step = max(self.seconds_per_step, (time.monotonic() - start) / steps)
        return loss, ms

    def out_of_budget(self, trials: int = 0, verifications: int = 0) -> bool:
        """Whether ``trials`` more trial runs and ``verifications`` more verification runs would pass the budget."""
        if self.options.budget_minutes is None:
            return False
        steps = trials * self.options.trial_steps + verifications * self.options.verify_steps
        left = 60 * self.options.budget_minutes - (time.monotonic() - self.started)
        return self.seconds_per_step * steps > left


def run_trial(config: TrainConfig, policy: str, seed: int, steps: int) -> tuple[float, float]:
    """Train ``steps`` updates of ``config``'s task under ``policy`` from ``seed`` (no run folder); the
    validation loss after them and the measured ms per step."""
    from mixprec.app.failures import BadBatchError
    from mixprec.app.run import build_trainer

    trainer, _, _ = build_trainer(config.replace(policy=policy, seed=seed, steps=steps, epochs=None), None, False)
    try:
        result = trainer.fit(steps=steps)
    except BadBatchError:  # a forward or loss made inf/NaN under this policy: no loss to compare, never chosen
        return math.inf, math.nan
    loss = float(result.eval.get("loss", result.train_loss))
    return loss, _steady_ms(result)


def _steady_ms(result: Any) -> float:
    """Milliseconds per step of a run's second half (the median of its later train records): the first steps of a
    short run carry its warm-up (kernel selection, allocator growth, the first run of a process above all),
    which a longer run of the same policy does not pay per step."""
    timed = [r["ms_per_step"] for r in result.history if r["kind"] == "train" and r["ms_per_step"] > 0]
    return statistics.median(timed[len(timed) // 2 :]) if timed else result.ms_per_step


def search(
    config: TrainConfig,
    options: TuneOptions,
    choices: dict[str, LayerChoice],
    profile: DeviceProfile | None,
    progress: Callable[[str], None] = lambda message: None,
    modules: Sequence[str] = (),
) -> dict[str, Any]:
    """Steps 2-5 of the module docstring; returns what ``tune.json`` holds. ``modules``: every module name of the
    model, for the policies' globs."""
    base = options.base
    state = SearchState(config, options, choices, profile or DeviceProfile("", base), None, progress, tuple(modules))
    progress(f"tune: trial of the uniform base ({base}) and of FP32, {options.trial_steps} steps each")
    base_loss, base_ms = state.trial(base)
    fp32_loss, _ = state.trial("fp32")
    forced = _forced(state)  # before a profile is measured: bf16 where a layer may take it
    reference_loss, reference_ms = base_loss, base_ms
    if not math.isfinite(base_loss) and forced:  # the doctor foresaw it: the base with its layers kept out instead
        progress("tune: the uniform base made inf/NaN; the reference is the base with the doctor's layers kept out")
        reference_loss, reference_ms = state.trial(assignment_policy(base, forced, state.modules))
    if profile is None:  # measured here: the step of the uniform base is this device's
        _measure_here(state, forced, reference_ms)
    reference = reference_loss if math.isfinite(reference_loss) else fp32_loss
    _references(state, base_loss, fp32_loss, reference)
    accepted = _first_moves(state, reference)
    accepted += _greedy(state, accepted[-1], reference)
    if state.not_tried:
        _say_not_tried(state)
    policy, assignment, verification = _verify(state, accepted)
    policy, assignment = _fastest_measured(state, policy, assignment, verification)
    return {
        "base": base,
        "tolerance": options.tolerance,
        "device_profile": {"device": state.profile.device, "source": state.profile.source},
        "trials": {
            "steps": options.trial_steps,
            "base_loss": base_loss,
            "fp32_loss": fp32_loss,
            "base_ms_per_step": base_ms,
            "reference_loss": reference_loss,
        },
        "layers": [_layer_record(c, state) for c in choices.values()],
        "candidates": [asdict(c) for c in state.candidates],
        "pareto": [asdict(c) for c in pareto_front(state.candidates)],
        "fp8_not_tried": state.not_tried,
        "chosen": {
            "policy": policy,
            "assignment": assignment,
            "prediction": state.predict(assignment).to_dict(),
        },
        "verification": verification,
        "seconds": round(time.monotonic() - state.started, 1),
    }


def _measure_here(state: SearchState, forced: dict[str, str], reference_ms: float) -> None:
    """The cost model measured on the device at hand (bf16 too where a layer may take it), and the uniform base's
    step from the reference's (the base with the doctor's layers kept out, where the base made inf)."""
    bf16 = any(BF16 in choice.formats for choice in state.choices.values())
    formats = (*FORMATS, BF16) if bf16 else FORMATS
    device = _device(state.config)
    state.profile = measure_profile(state.shapes().values(), state.options.base, device, progress=state.progress,
                                    formats=formats)  # fmt: skip
    state.base_step_ms = reference_ms - sum(_extra(state, name, fmt) for name, fmt in forced.items())


def _device(config: TrainConfig) -> Any:
    import torch

    from mixprec.app.run import resolve_device

    return torch.device(resolve_device(config.device))


def _forced(state: SearchState) -> dict[str, str]:
    """The layers the doctor keeps out of the base's 16 bits (they would overflow there), as an assignment: bf16
    where a layer may take it and the profile times it no slower than FP32 (or has not timed it yet), else FP32."""
    forced = {}
    for name, choice in state.choices.items():
        if "16" in choice.formats:
            continue
        bf16 = BF16 in choice.formats and (
            not state.profile.times(BF16) or _extra(state, name, BF16) <= _extra(state, name, "fp32")
        )
        forced[name] = BF16 if bf16 else "fp32"
    return forced


def _change(loss: float, reference: float) -> float:
    """``loss`` relative to ``reference``: inf for a run that made inf/NaN (never within a tolerance)."""
    return (loss - reference) / abs(reference) if math.isfinite(loss) and reference else math.inf


def _references(state: SearchState, base_loss: float, fp32_loss: float, reference: float) -> None:
    """The uniform base and FP32, tried first, as candidates (the front's two ends); FP32 predicted as every GEMM
    layer in FP32 on top of the base. Raises NoFiniteReference when even the reference is inf or NaN: before the
    search, which would have nothing to hold."""
    if not math.isfinite(reference):
        raise NoFiniteReference(f"the trial runs ({state.options.trial_steps} steps)")
    every_fp32 = {name: "fp32" for name in state.choices}
    for note, policy, assignment, loss in (("uniform base", state.options.base, {}, base_loss),
                                            ("uniform FP32", "fp32", every_fp32, fp32_loss)):  # fmt: skip
        change = _change(loss, reference)
        prediction = state.predict(assignment).to_dict()
        state.candidates.append(
            Candidate(policy, assignment, prediction, loss, change, change <= state.options.tolerance, note)
        )


def _extra(state: SearchState, name: str, fmt: str) -> float:
    """What running layer ``name`` in ``fmt`` adds to a step over its 16 bits (milliseconds, the profile's)."""
    shape = state.choices[name].shape
    return state.profile.layer_ms(shape, fmt)[0] - state.profile.layer_ms(shape, "16")[0]


def _first_moves(state: SearchState, reference: float) -> list[dict[str, str]]:
    """The layers the doctor keeps out of the base's 16 bits (no trial: they would overflow), then, as a trial,
    those the cost model finds faster in FP32 than in 16 bits."""
    forced = _forced(state)
    faster = {name: "fp32" for name in state.choices if name not in forced and _extra(state, name, "fp32") < 0}
    moves = [forced]
    for fmt, shown in (("fp32", "FP32"), (BF16, "bf16")):
        kept = ", ".join(f"{n} ({state.choices[n].reasons['16']})" for n, f in forced.items() if f == fmt)
        if kept:
            state.progress(f"tune: kept in {shown} by the doctor: {kept}")
    if faster:
        candidate = _record(state, {**forced, **faster}, reference, note="the layers faster in FP32 than in 16 bits")
        if candidate.accepted:
            moves.append({**forced, **faster})
    return moves


OUT_OF_BUDGET = "the time budget (--budget-minutes) ran out before its trial"


def _say_not_tried(state: SearchState) -> None:
    """One progress line: on how many layers FP8 was not tried, by reason."""
    why = list(state.not_tried.values())
    slower = sum(reason.startswith("FP8 predicted slower") for reason in why)
    budget = why.count(OUT_OF_BUDGET)
    other = sum(choice.shape.kind != "GEMM" for choice in state.choices.values())
    state.progress(
        f"tune: FP8 not tried on {len(why)} of {len(state.choices)} layers ({slower} predicted slower than their "
        f"current format by the cost model, {budget} past the time budget, {other} convolutions or attention, "
        f"{len(why) - slower - budget - other} ruled out by the doctor)"
    )


def _greedy(state: SearchState, assignment: dict[str, str], reference: float) -> list[dict[str, str]]:
    """FP8 for each layer the cost model finds faster there, least sensitive first, while the loss holds; the
    accepted assignments in order, each one layer more than the one before."""
    order = sorted(state.choices.values(), key=lambda c: (c.fp8_error, c.name))
    accepted, tried, out_of_budget = [], 0, False
    for choice in order:
        if "fp8" not in choice.formats:
            state.not_tried[choice.name] = choice.reasons["fp8"]
            continue
        current = assignment.get(choice.name, "16")
        now, fp8 = state.profile.layer_ms(choice.shape, current)[0], state.profile.layer_ms(choice.shape, "fp8")[0]
        if fp8 >= now:  # FP8 does not pay on this layer here: not worth a trial
            shown = {"16": state.options.base.removeprefix("mixed_"), "fp32": "FP32", BF16: "bf16"}[current]
            state.not_tried[choice.name] = f"FP8 predicted slower: {fp8:.3f} ms against {now:.3f} in {shown}"
            continue
        if out_of_budget or state.out_of_budget(trials=1, verifications=3 * state.options.seeds):
            if not out_of_budget:
                state.progress(f"tune: budget reached after {tried} FP8 trials; verifying what was accepted")
            out_of_budget = True
            state.not_tried[choice.name] = OUT_OF_BUDGET
            continue
        tried += 1
        trying = {**assignment, choice.name: "fp8"}
        if _record(state, trying, reference, note=f"+ {choice.name} in FP8").accepted:
            assignment = trying
            accepted.append(trying)
    return accepted


def _record(state: SearchState, assignment: dict[str, str], reference: float, note: str) -> Candidate:
    """A trial of ``assignment``, kept when its loss change is within the tolerance; said in a progress line."""
    policy = assignment_policy(state.options.base, assignment, state.modules)
    loss, _ = state.trial(policy)
    change = _change(loss, reference)
    ok = change <= state.options.tolerance
    prediction = state.predict(assignment)
    candidate = Candidate(policy, dict(assignment), prediction.to_dict(), loss, change, ok, note)
    state.candidates.append(candidate)
    verdict = "kept" if ok else "refused"
    state.progress(
        f"tune: [{len(state.candidates)}] {note}: loss {loss:.4f} ({100 * change:+.3f}%), predicted "
        f"{prediction.speedup:.3f}x {state.options.base} ({prediction.scope}) -> {verdict}"
    )
    return candidate


def _verify(state: SearchState, accepted: list[dict[str, str]]) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The uniform base and FP32 over ``seeds`` seeds, ``verify_steps`` each; then the accepted assignments,
    fastest first, until one keeps the mean validation loss within the tolerance of the reference's (the base's,
    FP32's where the base made inf/NaN). When even the last, the doctor's layers kept out alone, is past it, the
    reference itself is chosen: the tolerance holds on the verification by construction. With a cost model
    measured here, its predicted steps against the measured ones. Returns the policy, its assignment, the
    summary."""
    runs = {name: _seeded(state, name, policy) for name, policy in (("base", state.options.base), ("fp32", "fp32"))}
    means = {name: statistics.fmean(loss for loss, _ in results) for name, results in runs.items()}
    reference = means["base"] if math.isfinite(means["base"]) else means["fp32"]
    if not math.isfinite(reference):
        raise NoFiniteReference(f"the verification runs ({state.options.verify_steps} steps)")
    tried, change = [], math.inf
    for index, assignment in enumerate(reversed(accepted)):
        last, policy = index == len(accepted) - 1, assignment_policy(state.options.base, assignment, state.modules)
        if not last and state.out_of_budget(verifications=state.options.seeds):
            state.progress(f"tune: no time left to verify {policy}")
            continue  # fall back towards the base
        chosen = runs["base"] if not assignment else _seeded(state, "chosen", policy)
        mean = statistics.fmean(loss for loss, _ in chosen)
        change = _change(mean, reference)
        tried.append({"policy": policy, "mean": mean, "loss_change": change})
        if change <= state.options.tolerance:
            break
        state.progress(f"tune: {policy} verified at {100 * change:+.3f}%, past the tolerance: falling back")
    fallback = None
    if change > state.options.tolerance:  # every one past it: the reference, uniform
        fallback = "base" if math.isfinite(means["base"]) else "fp32"
        policy, assignment = _uniform(state)[fallback]
        chosen, mean, change = runs[fallback], means[fallback], 0.0
        state.progress(f"tune: every verified per-layer policy was past the tolerance: the reference, {policy}")
    runs["chosen"] = chosen
    summary = _verification_summary(runs, tried, reference=means["base"], mean=mean, change=change, state=state)
    if fallback is not None:
        summary["verdict"]["fallback"] = f"uniform {policy}: every verified per-layer policy was past the tolerance"
    if state.base_step_ms is not None:
        summary["cost_model"] = _cost_model_check(state, assignment, summary)
    return policy, assignment, summary


def _uniform(state: SearchState) -> dict[str, tuple[str, dict[str, str]]]:
    """The two uniform policies, each with its assignment (FP32: every layer in FP32)."""
    return {"base": (state.options.base, {}), "fp32": ("fp32", {name: "fp32" for name in state.choices})}


def _verification_summary(
    runs: dict[str, list[tuple[float, float]]],
    tried: list[dict[str, Any]],
    *,
    reference: float,
    mean: float,
    change: float,
    state: SearchState,
) -> dict[str, Any]:
    """Each verified policy's losses, mean and median step, the policies tried, and the verdict of the chosen one
    (``reference``: the base's mean, FP32's taken where it is not finite)."""
    summary: dict[str, Any] = {
        name: {
            "losses": [loss for loss, _ in results],
            "mean": statistics.fmean(loss for loss, _ in results),
            "ms_per_step": statistics.median(ms for _, ms in results),
        }
        for name, results in runs.items()
    }
    base = summary["base"]["losses"]
    summary["tried"] = tried
    summary["verdict"] = {
        "reference": "base" if math.isfinite(reference) else "FP32 run (the base made inf/NaN)",
        "loss_change": change,
        "base_seed_spread": max(base) - min(base),
        "within_tolerance": change <= state.options.tolerance,
        "within_base_spread": abs(mean - summary["base"]["mean"]) <= max(base) - min(base),
    }
    return summary


_MEASURED_MARGIN = 0.95  # a uniform policy replaces the chosen one only where its step measured 5% faster or more


def _fastest_measured(
    state: SearchState, policy: str, assignment: dict[str, str], verification: dict[str, Any]
) -> tuple[str, dict[str, str]]:
    """The policy to write and its assignment: the verified per-layer one; or, with the cost model measured here,
    the uniform base or uniform FP32 where the verification measured its step at least 5% faster and its loss
    within the tolerance. The cost model counts the layers alone, not what a 16-bit base adds around the layers it
    puts in FP32 (its region, the casts between layers): on a CPU with slow 16-bit kernels the per-layer policy
    that puts every layer in FP32 can measure far slower than FP32 itself. The verdict then describes the pick."""
    if state.base_step_ms is None or "chosen" not in verification:
        return policy, assignment
    verdict, chosen_ms = verification["verdict"], verification["chosen"]["ms_per_step"]
    means = {name: verification[name]["mean"] for name in ("base", "fp32")}
    reference = means["base"] if math.isfinite(means["base"]) else means["fp32"]  # as the verdict's
    uniform = _uniform(state)
    faster = [
        name
        for name in (("base", "fp32") if assignment else ("fp32",))
        if verification[name]["ms_per_step"] < _MEASURED_MARGIN * chosen_ms
        and _change(means[name], reference) <= state.options.tolerance
    ]
    if not faster:
        return policy, assignment
    name = min(faster, key=lambda n: verification[n]["ms_per_step"])
    change, ms = _change(means[name], reference), verification[name]["ms_per_step"]
    state.progress(
        f"tune: uniform {uniform[name][0]} measured {ms:.2f} ms a step against {chosen_ms:.2f} for {policy}, its "
        f"loss {100 * change:+.3f}%: chosen instead (the cost model does not count a 16-bit base's casts)"
    )
    spread = verdict["base_seed_spread"]
    verdict.update(
        loss_change=change, within_tolerance=True, within_base_spread=abs(means[name] - means["base"]) <= spread
    )
    verdict["replaced"] = policy
    verdict.pop("fallback", None)  # the uniform policy written is this one
    _replace_chosen(verification, name)
    return uniform[name]


def _replace_chosen(verification: dict[str, Any], name: str) -> None:
    """The verification's figures under "chosen" become the uniform ``name``'s, and the per-layer policy's are
    kept as "replaced", in the cost model's check too (which still ranks the per-layer policy: why it lost)."""
    verification["replaced"], verification["chosen"] = verification["chosen"], dict(verification[name])
    check = verification.get("cost_model")
    if check is None:
        return
    for key, value in check.items():
        if isinstance(value, dict) and "chosen" in value:
            check[key] = {("replaced" if n == "chosen" else n): v for n, v in value.items()}
        elif isinstance(value, list):
            check[key] = ["replaced" if n == "chosen" else n for n in value]


def _seeded(state: SearchState, name: str, policy: str) -> list[tuple[float, float]]:
    """(validation loss, ms per step) of ``verify_steps`` under ``policy`` from each of ``seeds`` seeds."""
    results = []
    steps = state.options.verify_steps
    for seed in range(state.config.seed, state.config.seed + state.options.seeds):
        state.progress(f"tune: verification, {name} seed {seed} ({steps} steps)")
        results.append(state.trial(policy, seed=seed, steps=steps))
    return results


def _cost_model_check(state: SearchState, assignment: dict[str, str], summary: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured ms per step for the verified policies (FP32 predicted as every GEMM layer in
    FP32 on top of the base: the rest of an FP32 step, outside the GEMM layers, is the base's in the model)."""
    every_fp32 = {name: "fp32" for name in state.choices}
    same_as_base = not assignment  # then "chosen" is the base's own runs: one policy, ranked once
    predicted = {"chosen": state.predict(assignment).step_ms, "base": state.base_step_ms,
                 "fp32": state.predict(every_fp32).step_ms}  # fmt: skip
    if same_as_base:
        del predicted["chosen"]
    measured = {name: summary[name]["ms_per_step"] for name in predicted}
    predicted = {name: ms for name, ms in predicted.items() if math.isfinite(measured[name])}  # a run that failed
    measured = {name: measured[name] for name in predicted}
    order = sorted(predicted, key=predicted.get)
    return {
        "predicted_ms": predicted,
        "measured_ms": measured,
        "predicted_over_measured": {n: predicted[n] / measured[n] for n in predicted if measured[n] > 0},
        # against the base: a machine that drifts between the timing and the runs moves both steps alike
        # a step of 0 ms or less has no ratio (a prediction stays positive: cost.predict fits layers to the step)
        "speedup_vs_base_predicted": {
            n: predicted["base"] / ms for n, ms in predicted.items() if "base" in predicted and ms > 0
        },
        "speedup_vs_base_measured": {
            n: measured["base"] / ms for n, ms in measured.items() if "base" in measured and ms > 0
        },
        "ranking_predicted": order,
        "ranking_measured": sorted(measured, key=measured.get),
        "ranking_agrees": order == sorted(measured, key=measured.get),
    }


def _layer_record(choice: LayerChoice, state: SearchState) -> dict[str, Any]:
    timed_bf16 = BF16 in state.profile.entries.get(choice.shape.key(), {})  # kept for --save-profile
    formats = (*choice.shape.formats, *([BF16] if BF16 in choice.formats or timed_bf16 else []))
    timings = {fmt: state.profile.layer_ms(choice.shape, fmt)[0] for fmt in formats}
    return {
        "name": choice.name,
        "kind": choice.shape.kind,
        "key": choice.shape.key(),
        "shape": asdict(choice.shape),
        "formats": list(choice.formats),
        "reasons": choice.reasons,
        "fp8_error": choice.fp8_error,
        "ms": timings,
    }
