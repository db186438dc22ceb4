"""The models a daemon serves: pool.py (loaded by name, kept alive, evicted, unloaded), settings.py (how many,
how long, in how much memory: light, the CLI reads it), catalog.py (what can be served, as the APIs list it)."""
