"""RL objectives: decoupled PPO loss, proximal-policy approximations, GRPO-family advantages, KL."""
