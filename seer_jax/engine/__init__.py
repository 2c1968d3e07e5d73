"""One mesh slice's inference engine: paged KV blocks, the jitted model runner, continuous
batching and speculative verification."""
