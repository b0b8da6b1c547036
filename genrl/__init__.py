"""genrl: reinforcement-learning fine-tuning (GRPO) of flow-matching image and video generators."""

__version__ = "0.1.0"
