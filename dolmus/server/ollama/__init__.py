"""Ollama's API (/api/...) on the OpenAI server's port: each module a thin translation between
Ollama's request and response shapes and the engine's, over the same `Serving` (model check,
admission, quotas, constraints, streams) as the OpenAI routes. See routes.py for what is served."""
