"""Where an engine's own virtual environment is: `.venv-vllm`, `.venv-sglang`, ... beside the repo or the CWD."""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO_ROOT", "EngineNotInstalledError", "find_venv_python"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class EngineNotInstalledError(FileNotFoundError):
    """No interpreter with the engine was given or found."""


def find_venv_python(venv: str, install_hint: str, search: list[Path] | None = None) -> str:
    """The interpreter of the first `venv` folder found under the repo root or the CWD."""
    roots = search if search is not None else [REPO_ROOT, Path.cwd()]
    tried = []
    for root in roots:
        candidate = Path(root) / venv / "bin" / "python"
        tried.append(str(candidate))
        if candidate.exists():
            return str(candidate)
    raise EngineNotInstalledError(
        f"no interpreter for this engine: pass --engine-python (EngineLaunchConfig.python), or run {install_hint} "
        f"to create {venv} (looked for {', '.join(tried)})"
    )
