"""The one native module: the shm sender's one-pass copy and checksum
(``src/pdserve/transfer/_hashcopy.c``). Everything else is configured in ``pyproject.toml``.

Built twice (baseline and AVX2; ``checksum.py`` picks one at import). Optional: on a machine
without a C compiler the install goes on without it, and the sender
copies with numpy and hashes with the xxhash package (the same checksums, one more pass over
memory; ``pdserve.transfer.checksum``).
"""

from setuptools import Extension, setup


def _hashcopy(name: str, *flags: str) -> Extension:
    return Extension(
        f"pdserve.transfer.{name}",
        sources=[f"src/pdserve/transfer/{name}.c"],  # one source, one object file per build
        include_dirs=["third_party/xxhash", "src/pdserve/transfer"],
        depends=["third_party/xxhash/xxhash.h", "src/pdserve/transfer/_hashcopy.c"],
        extra_compile_args=["-O3", *flags],
        optional=True,
    )


setup(
    ext_modules=[
        _hashcopy("_hashcopy"),
        # XXH3's AVX2 loop, imported only on a CPU that has AVX2 (``checksum.py``); a compiler
        # that does not know the flag (not x86) skips it.
        _hashcopy("_hashcopy_avx2", "-mavx2"),
    ]
)
