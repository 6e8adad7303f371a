"""User-facing entry points: the offline LLM class, chat-template rendering, the terminal chat."""
