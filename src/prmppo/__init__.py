"""prmppo: process-supervised PPO (PRM step rewards) against an outcome-reward control arm."""

__version__ = "0.1.0"
