"""Adapters that run mixprec inside other training frameworks, each built on the public API only.

``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin (needs the
``lightning`` extra). ``mixprec.integrations.transformers``: ``MixprecTrainer``, the Hugging Face Trainer under a
policy (needs transformers 5 and Accelerate). Both gate LR schedulers with
``mixprec.integrations.gated_scheduler.GatedScheduler``. Import the adapter you use.

Importing this package (``import mixprec`` does) registers the framework probes that need no adapter with the
engine's guard list (:mod:`mixprec.engine.guards`): :mod:`mixprec.integrations.accelerate`, the guard against
an update inside ``accelerator.accumulate()``. It imports no framework and no torch.
"""

from mixprec.integrations import accelerate  # noqa: F401  (registers its guard)
