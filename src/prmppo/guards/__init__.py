"""Launch gates (refuse a broken setup before any model loads) and tripwires (alarms while training)."""

from prmppo.guards.gates import GateError, check_topology, derive_eos, verifier_receipt
from prmppo.guards.tripwires import RatioTripwire, SkipBudget, TrainingAborted

__all__ = ["GateError", "RatioTripwire", "SkipBudget", "TrainingAborted", "check_topology", "derive_eos",
           "verifier_receipt"]
