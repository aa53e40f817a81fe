"""Registers ``twistd llmlb`` and ``twistd vllm-sim``; the code lives in the txlb package."""

from twisted.application.service import ServiceMaker

llmlb = ServiceMaker(
    "txlb load balancer",
    "txlb.tap",
    "A load balancer for LLM inference servers (vLLM and other OpenAI-compatible APIs), "
    "on the txlb-epoll reactor unless --reactor names another.",
    "llmlb",
)
vllm_sim = ServiceMaker(
    "txlb simulated vLLM backend",
    "txlb.simtap",
    "A simulated vLLM OpenAI-compatible server, for demos and tests.",
    "vllm-sim",
)
