"""The math of training: SDE sampling steps and their log-probs, advantages, and the objectives' losses.

Pure float32 functions whose docstrings carry the formulas."""
