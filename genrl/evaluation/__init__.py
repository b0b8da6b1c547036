"""Evaluation: bounded, deterministic scoring of a policy on held-out prompts, and what it writes."""
