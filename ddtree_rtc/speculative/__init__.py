"""Speculative decoding glue: tree build/accept, the DDTree round, drafters."""
