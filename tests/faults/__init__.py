"""Fault injection: crash points, corrupt files, mismatched ranks and bad input, simulated
deterministically (no timed kills), each checked to fail cleanly and lose nothing."""
