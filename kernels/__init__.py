"""Custom dispatches (draft top-K with log-probs), one kernel body for every backend. Not built yet."""
