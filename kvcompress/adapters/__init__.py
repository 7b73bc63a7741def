"""Adapters to model libraries.  ``hf`` is the only module that touches transformers."""
