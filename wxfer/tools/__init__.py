"""Command-line tools: the end-to-end demo and the transport self-tests (python -m wxfer ...)."""
