/* ``_attention`` built with AVX2 and FMA under its own name and object file (8-lane vectors
 * for the fp32 kernels); ``cpu_attention.py`` imports it on a CPU that has AVX2 and FMA but
 * not AVX512-BF16. */
#define ATTENTION_NAME _attention_avx2
#include "_attention.cpp"
