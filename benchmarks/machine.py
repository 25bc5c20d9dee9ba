"""The machine a benchmark ran on, recorded next to its results."""

from mixprec.app.machine import machine_info as machine

__all__ = ["machine"]
