"""Adapters that run mixprec inside other training frameworks, each built on the public API only.

``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin (needs the
``lightning`` extra). ``mixprec.integrations.transformers``: ``MixprecTrainer``, the Hugging Face Trainer under a
policy (needs transformers 5 and Accelerate). Both gate LR schedulers with
``mixprec.integrations.gated_scheduler.GatedScheduler``. Import the adapter you use.

Importing this package (``import mixprec`` does) registers the framework probes that need no adapter with the
engine's guard list (:mod:`mixprec.engine.guards`): :mod:`mixprec.integrations.accelerate`, the guard against
an update inside ``accelerator.accumulate()``, and :mod:`mixprec.integrations.accelerate_skipped`, which makes
Accelerate's ``step_was_skipped`` (read by a prepared scheduler) report MixedPrecision's skips. Neither imports a
framework or torch.
"""

from mixprec.integrations import accelerate, accelerate_skipped  # noqa: F401  (register their guards)
