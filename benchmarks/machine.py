"""The machine a benchmark ran on, recorded next to its results."""

from mixprec.policy.hardware import machine_info as machine

__all__ = ["machine"]
