"""omniloop: a completion-driven serving engine for multi-stage speech models."""

__version__ = "0.1.0"
