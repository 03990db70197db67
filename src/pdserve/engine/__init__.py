"""The paged-KV, continuously batching engine: scheduler, block manager, model runner, sampler."""
