"""``gradcomm bench``: the CLI and emulated multi-node runs."""
