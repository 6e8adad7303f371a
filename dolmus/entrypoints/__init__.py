"""User-facing entry points: the offline LLM class and chat-template rendering."""
