"""Checkpoints: saving and resuming the DDP, the hook state and the bucket layout."""
