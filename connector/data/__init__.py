"""Real request traces shipped with pdtrace for the lab's workload replay.

- ``AzureLLMInferenceTrace_conv.csv``: Azure LLM inference trace 2023,
  conversation (Patel et al., Splitwise, ISCA 2024), CC-BY 4.0,
  https://github.com/Azure/AzurePublicDataset. Copied byte for byte.
- ``conversation_trace.jsonl``: Mooncake FAST'25 conversation trace
  (Qin et al., FAST 2025), Apache-2.0, https://github.com/kvcache-ai/Mooncake.
  Copied byte for byte.

See ``ATTRIBUTION.md`` and the two ``README-*.md`` files (columns, units, caveats).
"""
from pathlib import Path

DIR = Path(__file__).resolve().parent
AZURE_CONV = DIR / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = DIR / "conversation_trace.jsonl"
