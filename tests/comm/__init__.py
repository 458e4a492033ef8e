"""Communication: collectives, futures, the launcher, the rank harness, shaped networks, faults, telemetry."""
