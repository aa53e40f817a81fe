"""
What a request is routed by: the routing key a policy's ``choose`` can see.

The proxy reads a request's body once (it is a JSON object for every OpenAI-style call)
to find the model it names; :class:`RoutingRequest` carries what that reading found, plus
the session key of ``--affinity`` and the client key of ``--rate-key``, to the router and
on to the policy.  Policies that only balance load ignore it; a cache-aware policy routes
by the prompt (:meth:`RoutingRequest.prompt`), which is extracted only when one asks, from
the JSON object already parsed -- never by parsing the body a second time.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from txlb._config.classes import DEFAULT_CLASS
from txlb._scheduling.work import WorkBudget


@attrs.frozen
class RoutingRequest:
    """One request as scheduling sees it.  Every field may be absent (``None``, empty)."""

    #: the model the request names, after alias resolution (what the backend will see)
    model: str | None = None
    #: the ``--affinity`` session key (a header's value or the body's ``user``)
    session: str | None = None
    #: the ``--rate-key`` client key (an address, or a header's value)
    client: str | None = None
    #: the tenant whose API key the request presented (``--auth keys``), ``None`` without
    #: keys: what the fair queue, the budgets and the result log know it by
    tenant: str | None = None
    #: the tenant's fair-share weight (its counter advances by its cost over this)
    weight: float = 1.0
    #: the priority class's name (:mod:`txlb._scheduling.classes`): where it waits in the
    #: ``max_conns`` queue; a name no class has waits in the default class
    priority: str = DEFAULT_CLASS
    #: the request body as it will be forwarded (bytes twisted.web has already read)
    body: bytes = attrs.field(default=b"", repr=False)
    #: the body parsed as a JSON object, when it is one (the parse the proxy made anyway)
    json: Mapping[str, object] | None = attrs.field(default=None, repr=False, eq=False)
    #: the work routing may still spend on the body (:mod:`txlb._scheduling.work`): the
    #: bytes :attr:`json` was read within, the steps the routing key may render
    budget: WorkBudget = attrs.field(factory=WorkBudget, repr=False, eq=False)
    #: what a policy worked out from this request (a cache-aware policy's block chain),
    #: kept for the request's life -- its queue wait, its retries -- so that it is worked
    #: out once; keyed by whoever stored it, and never part of the request's identity
    memo: dict[object, object] = attrs.field(factory=dict, init=False, repr=False,
                                             eq=False)

    def prompt(self) -> str | None:
        """
        The text a prefix (KV) cache would see first: a completion's ``prompt``, or a chat's
        message contents joined in order; ``None`` when the body has neither.  Computed on
        each call, so a policy that never asks pays nothing.
        """
        if self.json is None:
            return None
        prompt = self.json.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        messages = self.json.get("messages")
        if not isinstance(messages, list):
            return None
        parts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts.extend(part["text"] for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        return "\n".join(parts) if parts else None


#: A request nothing is known about (a caller that routes by load alone).
ANY_REQUEST = RoutingRequest()
