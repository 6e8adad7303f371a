"""The OpenAI-compatible HTTP server (`dolmus serve`)."""
