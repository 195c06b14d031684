"""Rewards: scorers, reward managers, custom reward functions, Ray reward pool."""
