"""Built-in scorers, pickers and stages, one per file. Scorers and pickers are registered by name in router.policies;
stages (router/interfaces.py) are given to the Router by the frontend from its config."""

from router.plugins.affinity import SessionAffinity
from router.plugins.kv import KvCostScorer
from router.plugins.load import LoadScorer
from router.plugins.lora import AdapterAffinity
from router.plugins.pickers import MaxScorePicker, RandomPicker, RoundRobinPicker, SoftmaxPicker

__all__ = ["AdapterAffinity", "KvCostScorer", "LoadScorer", "MaxScorePicker", "RandomPicker", "RoundRobinPicker", "SessionAffinity",
           "SoftmaxPicker"]
