"""Speculative decoding: propose a few tokens per decoding row cheaply, verify them in one forward.

`config.py` holds the options, `ngram.py` the prompt-lookup proposer, `draft_length.py` the rule that
picks each row's draft length per step, `decoder.py` the per-request state that ties them to the engine
(all four torch-free), and `draft_model.py` the proposer that runs a smaller model. The verification
itself is the runner's (runner/verify.py).
"""
