"""LoRA adapters over a loaded base model: rows of several adapters (and of none) in one step."""
