"""
Each LLM API's answer read into a :class:`~txlb._records.answers.completion.Completion`
(or, for embeddings, an :class:`~txlb._records.answers.embeddings.Embeddings`): one module
per API, so that what an API's answer says, and where, is read in one place.

:mod:`.chat` reads OpenAI's chat completions and completions (one shape: ``choices``),
:mod:`.responses` the Responses API, :mod:`.messages` the Anthropic-style Messages API and
:mod:`.embeddings` embeddings; :mod:`.completion` is what they share.  The folds of the three
that stream (``add`` one event at a time, ``end`` for the result) serve alike a stream
summarised as it passes (:class:`~txlb._records.capture.StreamCapture`) and a body read
whole.  Nothing here imports the summary: it reads these, never the other way round.
"""
