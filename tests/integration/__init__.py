"""Integration tests: the real ``twistd -n llmlb`` and the real parts (nginx, Chromium,
llama-server, promtool, curl, the openai client) on loopback sockets."""
