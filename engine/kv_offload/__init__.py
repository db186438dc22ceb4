"""A second tier for the prefix cache's blocks: files on disk that outlive the pool, the model and the daemon."""
