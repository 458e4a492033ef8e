"""Compression methods on their own, through the compression hook, and in training."""
