"""Engine: request scheduler, continuous batching, paged KV cache, CUDA-graph capture."""
