"""Adapters for training frameworks: the only modules that import Lightning or transformers."""
