"""Build hook for the two C extensions: router._kvcore (block hashing + prefix matching) and
orchestrator._relaycore (the SSE relay's per-chunk step, on every streamed token).

Everything else about the distribution lives in pyproject.toml. The extensions are optional: if one
cannot be compiled (no C compiler or Python headers), installation still succeeds and kvyard uses
the pure-Python twins, which give identical results (and logs once that it does).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router._kvcore",
            sources=["router/_kvcore.c"],
            include_dirs=["router/_vendor/xxhash"],
            depends=["router/_vendor/xxhash/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "orchestrator._relaycore",
            sources=["orchestrator/_relaycore.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
