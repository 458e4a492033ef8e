"""The communication hooks: each hook, the registry, agreement across ranks, properties of every hook."""
