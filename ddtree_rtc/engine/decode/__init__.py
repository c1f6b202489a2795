"""Decoding, called by the engine's step and never calling back: one autoregressive forward, or one
DDTree / chain round (its tree buffers in ``tree``)."""
