"""The experiment harness (apart from the library): data, models, methods, one run, sweeps, reports.

Needs the ``experiments`` extra (matplotlib, rich, mlxtend, mnist1d, pytorch-optimizer); the
command line is ``adasum train`` / ``adasum compare`` (``python -m adasum``).
"""
