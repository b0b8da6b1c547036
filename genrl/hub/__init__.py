"""Publishing: model cards, pushes to the Hugging Face Hub, and secrets kept out of both."""
