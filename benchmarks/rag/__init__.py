"""RAG segments: quality per recomputation ratio, selection variants, TTFT."""
