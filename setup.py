"""The one native module: the shm sender's one-pass copy and checksum
(``src/pdserve/transfer/_hashcopy.c``). Everything else is configured in ``pyproject.toml``.

Optional: on a machine without a C compiler the install goes on without it, and the sender
copies with numpy and hashes with the xxhash package (the same checksums, one more pass over
memory; ``pdserve.transfer.checksum``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pdserve.transfer._hashcopy",
            sources=["src/pdserve/transfer/_hashcopy.c"],
            include_dirs=["third_party/xxhash"],
            depends=["third_party/xxhash/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
