"""The native modules. Everything else is configured in ``pyproject.toml``.

- The shm sender's one-pass copy and checksum (``src/pdserve/transfer/_hashcopy.c``), built
  twice (baseline and AVX2; ``checksum.py`` picks one at import). Without it the sender copies
  with numpy and hashes with the xxhash package (the same checksums, one more pass over memory;
  ``pdserve.transfer.shm.checksum``).
- The CPU attention kernels (``src/pdserve/models/_attention.cpp``), built three times
  (portable, AVX2 and AVX512-BF16; ``cpu_attention.py`` picks one at import). Without them the model attends with
  torch's ``scaled_dot_product_attention``. Compiled with ``-fopenmp`` but NOT linked against
  an OpenMP library: the OpenMP calls bind at import to the runtime torch has already loaded,
  so the kernels share torch's threads (see ``_attention_common.h``).

All are optional: on a machine without a C/C++ compiler the install goes on without them.
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


_ATTENTION_SOURCES = [
    f"src/pdserve/models/_attention{part}"
    for part in (".cpp", "_common.h", "_portable.h", "_avx512.h")
]


def _attention(name: str, *flags: str) -> Extension:
    return Extension(
        f"pdserve.models.{name}",
        sources=[f"src/pdserve/models/{name}.cpp"],
        include_dirs=["src/pdserve/models"],
        depends=_ATTENTION_SOURCES,
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-exceptions", "-Wno-maybe-uninitialized", *flags],
        optional=True,
    )


setup(
    ext_modules=[
        _hashcopy("_hashcopy"),
        # XXH3's AVX2 loop, imported only on a CPU that has AVX2 (``checksum.py``); a compiler
        # that does not know the flag (not x86) skips it.
        _hashcopy("_hashcopy_avx2", "-mavx2"),
        _attention("_attention"),
        _attention("_attention_avx2", "-mavx2", "-mfma"),
        # The bf16 kernels on vdpbf16ps; imported only on a CPU with AVX512-BF16.
        _attention(
            "_attention_avx512bf16",
            "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
        ),
    ]
)
