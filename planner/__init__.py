"""SLA planner: scales prefill/decode pools against TTFT, ITL and tokens/s targets (not built yet)."""

__all__: list[str] = []
