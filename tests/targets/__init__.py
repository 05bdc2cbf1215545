"""The code-generation targets, one folder each."""
