"""Hardware projection of K2.6 AR and DDTree decoding (docs/hardware.md)."""
from .model import ProjectionError, RoundModel, experts_touched, load_platforms, project, tau_curve

__all__ = ["ProjectionError", "RoundModel", "experts_touched", "load_platforms", "project", "tau_curve"]
