"""Shared builders a TrainSpec points at: optimizer, lr schedule, loss, tokenizer, data, metrics."""
