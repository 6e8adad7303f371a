"""Load generation, trace replay and batching tuning (`dolmus bench | replay | tune`)."""
