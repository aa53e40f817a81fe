"""Unit tests: in memory, on an injected clock; no child process, no real time."""
