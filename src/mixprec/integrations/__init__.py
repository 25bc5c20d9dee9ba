"""Adapters that run mixprec inside other training frameworks, each built on the public API only.

``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin (needs the
``lightning`` extra). ``mixprec.integrations.transformers``: ``MixprecTrainer``, the Hugging Face Trainer under a
policy (needs transformers 5 and Accelerate). Both gate LR schedulers with
``mixprec.integrations.gated_scheduler.GatedScheduler``. Importing this package imports nothing; import the
adapter you use.
"""
