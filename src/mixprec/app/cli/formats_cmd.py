"""``mixprec formats``: the float formats side by side, and what each stores for given values."""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING

from mixprec.app.cli.table import render_table

if TYPE_CHECKING:  # torch is imported when the command runs, so that --help answers at once
    from mixprec.numerics import Format


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "formats",
        help="the float formats side by side: bits, range, epsilon, subnormals",
        description="Show float formats side by side, or what each format stores for given values.",
    )
    parser.add_argument(
        "--value",
        "-v",
        type=float,
        nargs="+",
        metavar="X",
        help="show what each format stores for these values (exact, rounded, underflow, overflow)",
    )
    parser.add_argument(
        "--format",
        "-f",
        dest="formats",
        nargs="+",
        metavar="NAME",
        help="formats to show (default: all named ones); any alias or eXmY string, e.g. e3m2",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mixprec.numerics import FORMATS, get_format

    formats = (
        [get_format(name, argument="--format") for name in args.formats] if args.formats else list(FORMATS.values())
    )
    if args.value:
        records = [{"value": v, **represent(v, fmt)} for v in args.value for fmt in formats]
        print(json.dumps(_strict(records), indent=2) if args.json else values_table(args.value, formats, records))
    else:
        print(json.dumps([format_record(f) for f in formats], indent=2) if args.json else formats_table(formats))
    return 0


def _strict(records: list[dict]) -> list[dict]:
    """inf and NaN as the strings "inf", "-inf", "nan": strict JSON has no Infinity or NaN."""
    return [
        {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        for record in records
    ]


def format_record(fmt: Format) -> dict:
    return {
        "format": fmt.name,
        "bits": fmt.total_bits,
        "exponent_bits": fmt.exponent_bits,
        "mantissa_bits": fmt.mantissa_bits,
        "bias": fmt.bias,
        "min_exponent": fmt.min_exponent,
        "max_exponent": fmt.max_exponent,
        "max": fmt.max,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "eps": fmt.eps,
        "decimal_digits": round(fmt.decimal_digits, 2),
        "has_inf": fmt.has_inf,
        "needs_loss_scaling": fmt.needs_loss_scaling,
        "torch_dtype": str(fmt.torch_dtype) if fmt.torch_dtype is not None else None,
    }


def formats_table(formats: list[Format]) -> str:
    headers = [
        "format",
        "bits s/e/m",
        "exponent",
        "max",
        "min normal",
        "min subnormal",
        "epsilon",
        "digits",
        "inf",
        "loss scaling",
        "torch dtype",
    ]
    rows = [
        [
            f.name,
            f"{f.total_bits} (1/{f.exponent_bits}/{f.mantissa_bits})",
            f"{f.min_exponent}..{f.max_exponent}",
            _number(f.max),
            f"{f.min_normal:.3g}",
            f"{f.min_subnormal:.3g}",
            f"{f.eps:.3g}",
            f"{f.decimal_digits:.1f}",
            "yes" if f.has_inf else "no (saturates)",
            "usually needed" if f.needs_loss_scaling else "not needed",
            str(f.torch_dtype).removeprefix("torch.") if f.torch_dtype is not None else "-",
        ]
        for f in formats
    ]
    return render_table(headers, rows, align="lrrrrrrrlll")


def _number(value: float) -> str:
    """Exact integers as such (65504, 448), everything else to 4 significant digits."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e7 else f"{value:.4g}"


def represent(value: float, fmt: Format) -> dict:
    """What ``fmt`` stores for ``value``: the stored number and what happened to it."""
    import torch

    from mixprec.numerics import quantize

    stored = quantize(torch.tensor([value], dtype=torch.float64), fmt).item()
    if math.isnan(value):
        outcome = "NaN stays NaN"
    elif stored == value:
        outcome = "exact (subnormal)" if 0 < abs(value) < fmt.min_normal else "exact"
    elif stored == 0.0:
        outcome = "underflow to 0"
    elif math.isinf(stored):
        outcome = "overflow to inf"
    elif abs(stored) == fmt.max and abs(value) >= fmt.overflow_threshold and not fmt.has_inf:
        outcome = "overflow, saturates to max"  # a format with inf rounds up to inf past its threshold instead
    else:
        relative = abs(stored - value) / abs(value)
        kind = "rounded to a subnormal" if abs(stored) < fmt.min_normal else "rounded"
        outcome = f"{kind} (rel. error {relative:.2e})"
    return {"format": fmt.name, "stored": stored, "outcome": outcome}


def values_table(values: list[float], formats: list[Format], records: list[dict]) -> str:
    blocks = []
    for i, value in enumerate(values):
        rows = [
            [r["format"], f"{r['stored']:.9g}", r["outcome"]]
            for r in records[i * len(formats) : (i + 1) * len(formats)]
        ]
        blocks.append(f"value {value!r}\n" + render_table(["format", "stored", "outcome"], rows, align="lrl"))
    return "\n\n".join(blocks)
