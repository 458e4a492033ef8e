"""One module per compression method; each registers itself (see :mod:`gradcomm.compression.registry`)."""
