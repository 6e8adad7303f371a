"""Speculative decoding: proposers of draft tokens (engine side) and their verification (runner side)."""
