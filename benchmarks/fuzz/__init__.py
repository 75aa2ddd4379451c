"""The fuzz properties of every parser of untrusted input (shared with ``tests/fuzz``) and their long run."""
