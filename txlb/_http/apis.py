"""
Which LLM API a request's path names: what decides how its answer is read.

The record (what to keep of the answer), the summary (how to read it), the result log's
text line (whether it names its path) and the token budgets (which requests they estimate)
all ask this one table, so that they agree on what an LLM request is.  It imports nothing,
so any of them can.
"""

from __future__ import annotations

#: The LLM APIs txlb summarises, by path: OpenAI's chat and completions (also without
#: ``/v1``, as an ``openai`` client whose base URL lacks it sends them), the Responses API,
#: the Anthropic-style Messages API (vLLM and llama.cpp serve it) and embeddings.
API_PATHS = {
    b"/v1/chat/completions": "chat",
    b"/chat/completions": "chat",
    b"/v1/completions": "chat",
    b"/completions": "chat",
    b"/v1/responses": "responses",
    b"/responses": "responses",
    b"/v1/messages": "messages",
    b"/v1/embeddings": "embeddings",
    b"/embeddings": "embeddings",
}
#: The two paths whose text line does not name its path (it is what the line always was).
CLASSIC_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})
