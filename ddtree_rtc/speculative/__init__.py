"""Drafters behind the round's Drafter interface: the oracle, random and DFlash drafters."""
