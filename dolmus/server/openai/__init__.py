"""OpenAI's API (completions, chat completions): one module per endpoint, each a thin
translation between OpenAI's request/response shapes and the engine's (server/serving_common.py
does the rest); shared.py holds what both endpoints' shapes have in common."""
