"""``mixprec tune``: a search over per-layer formats for the fastest policy within an accuracy tolerance, from the
doctor's statistics, exact emulated trials and a per-device cost model (docs/tune.md).

:mod:`~mixprec.app.tune.layers` (shapes, allowed formats), :mod:`~mixprec.app.tune.cost` (device profiles,
predictions), :mod:`~mixprec.app.tune.search` (trials, greedy, verification), :mod:`~mixprec.app.tune.run` (one
task end to end, the files), :mod:`~mixprec.app.tune.report` (plot and Markdown).
"""
