"""Adapters that run mixprec inside other training frameworks, each built on the public API only.

``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin (needs the
``lightning`` extra). Importing this package imports nothing; import the adapter you use.
"""
