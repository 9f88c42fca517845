"""Logging, paths, device facts and other helpers with no training logic."""
