"""Model definitions, checkpoint loading and the locally-made demo checkpoints."""
