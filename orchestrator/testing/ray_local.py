"""A local Ray cluster for tests, started once more if Ray's own start-up window runs out.

Ray gives a starting raylet 30 s to register with its GCS ("The current node timed out during startup"). On a
loaded 2-core CI machine that window was missed once while the same test passed in 11 s on its own right after;
the tests are about kvyard's Ray connector and `kvyard up --ray`, not Ray's start-up, so a second start is tried
after a clean shutdown. Any other error, or a second timeout, fails the test as before.
"""

from __future__ import annotations

import os

__all__ = ["start_local_ray"]


def start_local_ray(num_cpus: int):
    """ray, initialised with a private local cluster of `num_cpus` CPUs (the caller shuts it down)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # test process only: no usage reporting
    import ray

    for attempt in (1, 2):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
            return ray
        except Exception as exc:  # ray raises a plain Exception for this
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
    raise AssertionError("unreachable")
