/* ``_hashcopy`` built with ``-mavx2`` (XXH3's AVX2 loop) under its own name and object file;
 * ``checksum.py`` imports it only on a CPU that has AVX2. */
#define HASHCOPY_NAME _hashcopy_avx2
#include "_hashcopy.c"
