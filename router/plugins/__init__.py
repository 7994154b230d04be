"""Built-in scorers and pickers, one per file. Registered by name in router.policies."""

from router.plugins.kv import KvCostScorer
from router.plugins.load import LoadScorer
from router.plugins.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker, SoftmaxPicker

__all__ = ["KvCostScorer", "LoadScorer", "MaxScorePicker", "RandomPicker", "RoundRobinPicker", "SoftmaxPicker"]
