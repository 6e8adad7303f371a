"""`dolmus eval` building blocks: task-file parsing and answer scorers (CLI/engine wiring not yet done)."""
