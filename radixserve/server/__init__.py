"""The OpenAI-compatible HTTP server, its engine process, and its metrics."""
