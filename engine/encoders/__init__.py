"""Encoder models (BERT, XLM-RoBERTa, NomicBERT): their config, the bidirectional forward, their weights."""
