"""Requests, scheduling, sampling, the step loop and the offline ``LLM`` API."""

from radixserve.engine.engine import Engine, StepOutput
from radixserve.engine.llm import LLM, RequestOutput
from radixserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams", "StepOutput"]
