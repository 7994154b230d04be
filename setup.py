"""Build hook for the one C extension, router._kvcore (block hashing + prefix matching).

Everything else about the distribution lives in pyproject.toml. The extension is optional: if it
cannot be compiled (no C compiler or Python headers), installation still succeeds and the router
uses its pure-Python fallbacks, which give identical values (and logs once that it does).
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
        )
    ]
)
