"""The optimisation helpers under their PPO-side name; they live in `prmppo/optim.py`, shared with SFT and PRM."""

from prmppo.optim import AUTOCAST_MODES, LOW_PRECISION, MasterWeights, adamw  # noqa: F401
