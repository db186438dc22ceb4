"""minibatch's engine.

Two entry points: `factory.build_engine` (a model, its weights and KV cache, wired) and `async_engine.AsyncEngine`
(the engine thread behind an asyncio API). The parts, by folder: core/ (torch-free: requests, KV blocks, the
scheduler and its policies, the step loop, outputs), spec_decode/ (speculative decoding's proposer and draft-length
rule, torch-free), runner/ (one step as one forward, sampling, KV tensors,
CUDA graphs), attention/, models/ (the forwards), weights/ (loading, quantized modules), gguf/, store/ (model
resolution), text/ (tokenizer, grammars) and testing/ (the test seam).
"""
