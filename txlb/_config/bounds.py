"""
Limits that a config option checks and the code it configures enforces.

A value both sides must agree on is written here, below both: the option's parser refuses
what the enforcing code could not honour, without the config importing that code.
"""

#: The most characters of an answer ``--log-content`` may keep in the result log: 1,000
#: characters take at most 12,000 bytes escaped, which keeps a completion line under the
#: result log's longest line.
MAX_PREVIEW_CHARS = 1000
#: ``--log-content``'s default, which a summary made without a config keeps too
DEFAULT_PREVIEW_CHARS = 200
