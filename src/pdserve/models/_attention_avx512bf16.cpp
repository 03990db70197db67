/* ``_attention`` built with AVX-512 and AVX512-BF16 under its own name and object file;
 * ``cpu_attention.py`` imports it only on a CPU that has those features. */
#define ATTENTION_NAME _attention_avx512bf16
#include "_attention.cpp"
