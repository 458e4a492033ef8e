"""gradcomm.DiLoCo: its pieces, training on ranks, and faults."""
