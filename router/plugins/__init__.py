"""Built-in scorers and pickers, one per file. Registered by name in router.registry."""

from router.plugins.load import LoadScorer
from router.plugins.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker

__all__ = ["LoadScorer", "MaxScorePicker", "RandomPicker", "RoundRobinPicker"]
