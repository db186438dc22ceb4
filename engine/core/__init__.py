"""The engine's torch-free core: requests, sampling parameters, the KV block manager, the scheduler with its two
batching policies (continuous, static), the step loop (`LLMEngine`), outputs, the step timeline and the
incremental detokenizer. No torch here: the runner and the tokenizer come in through `LLMEngine`'s constructor,
so all of it is tested with a fake runner in milliseconds."""
