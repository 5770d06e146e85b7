"""Online RL: GRPO, RLOO and PPO (with its critic) over tree calls; ``mixin.py`` is what they share."""
