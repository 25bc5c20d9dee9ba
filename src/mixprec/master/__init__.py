"""Master weights: FP32 copies for low-precision models, or compensated updates without them."""

from mixprec.master.compensated import UPDATE_MODES, AdamW
from mixprec.master.weights import MasterWeights

__all__ = ["UPDATE_MODES", "AdamW", "MasterWeights"]
