"""Rewards: per-token reward tensors [B, T] for the PPO loop (outcome, process, KL penalty)."""
