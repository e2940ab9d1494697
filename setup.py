"""The optional C extension that decodes a batch of row frames off the GIL.

``optional=True``: where it does not compile (no compiler, no Python headers) the install
still succeeds and row frames decode in Python (mmreplay.backends.native_rows).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mmreplay._rowdecode",
            sources=["mmreplay/_rowdecode.c"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            optional=True,
        )
    ]
)
