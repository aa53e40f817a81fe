"""What txlb writes to its logs: the escaping of a logged value, the quiet service log."""
