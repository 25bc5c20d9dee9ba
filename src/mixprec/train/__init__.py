"""Training on built-in tasks and user models (the trainer arrives with its own issue)."""
