"""minibatch on Ray Serve: engine replicas, a prefix-aware request router, and one API in front (`minibatch-serve`).

Nothing outside this package imports it, and only this package imports Ray.
"""
