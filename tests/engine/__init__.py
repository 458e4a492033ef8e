"""The DDP engine: the reducer, bucketing, staging, gradient views, drop-in parity with torch's DDP."""
