"""A training run: its arguments, live state, and the phases of an epoch (rollout, experience, update, logging)."""
