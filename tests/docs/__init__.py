"""The manual's examples, run (tests/docs/examples.py reads the pages)."""
