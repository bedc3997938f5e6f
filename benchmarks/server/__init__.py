"""The HTTP server's reliability under bad input and load."""
