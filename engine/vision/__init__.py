"""Images in: the vision towers and projectors that turn an image into the text model's input embeddings."""
