"""HTTP rules every side of txlb shares: headers, error bodies, API paths, failures in words."""
