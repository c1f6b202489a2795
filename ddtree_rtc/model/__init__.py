"""Model code: config, checkpoint loading, INT4 repack, target layers, drafter."""
