"""PPO: the pure maths (`maths`) and the training loop built on it."""
