"""Text datasets: sources (bundled, local files, hub), the token cache, and packing."""
