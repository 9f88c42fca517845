"""A PyTorch-native LLM pre-training framework with one activation-checkpointing module."""
