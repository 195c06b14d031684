"""The RL training loop: data, rollouts with tools, rewards, advantages, updates, weight sync, logging."""
