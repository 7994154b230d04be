"""The simulated engine: a drop-in vLLM 0.32 server whose forward passes are timed from measured profiles.

Pure cores (`KvBlockManager`, `Scheduler`, `TimingModel`, `BlockHasher`) are importable without
starting anything; `python -m workers.sim` runs the server; `SimBackend` launches it for kvyard.
"""

from workers.sim.backend import SIM_TOKENIZER_DIR, SimBackend, sim_tokenizer_path
from workers.sim.hashing import BlockHasher
from workers.sim.kv_manager import KvBlockManager
from workers.sim.profiles import BUNDLED, DEFAULT_PROFILE, Profile, load_profile
from workers.sim.scheduler import Scheduler, SimRequest, StepPlan, StepResult
from workers.sim.timing import TimingModel

__all__ = [
    "BUNDLED",
    "BlockHasher",
    "DEFAULT_PROFILE",
    "KvBlockManager",
    "Profile",
    "SIM_TOKENIZER_DIR",
    "Scheduler",
    "SimBackend",
    "SimRequest",
    "StepPlan",
    "StepResult",
    "TimingModel",
    "load_profile",
    "sim_tokenizer_path",
]
