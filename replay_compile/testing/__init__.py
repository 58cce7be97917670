"""Property-based equivalence testing as a feature.

* :func:`check_equivalence` (and ``replay-compile verify``): your model, compiled vs eager, over >= 2L+1 steps.
* :mod:`replay_compile.testing.strategies`: hypothesis strategies for shapes, step schedules and cursors, and an
  exact fp64 oracle (needs ``hypothesis``).
* :mod:`replay_compile.testing.hf_models`: tiny random transformers models of the Mamba-2 family.
"""

from .equivalence import EquivalenceReport, check_equivalence

__all__ = ["EquivalenceReport", "check_equivalence"]
