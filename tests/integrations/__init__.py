"""gradcomm under Lightning and Accelerate."""
