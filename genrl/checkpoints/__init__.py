"""Checkpoints and exports: saving, resuming, the output folder's lock and per-node storage."""
