"""API keys: who may change the catalog (and, when reads are closed, read it)."""
