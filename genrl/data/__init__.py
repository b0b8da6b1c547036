"""Prompts: prompt sets, conditioning images, the toy world, prompt-group sampling and seeds."""
