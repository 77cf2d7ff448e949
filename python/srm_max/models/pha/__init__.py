"""The Parallel Hybrid Architecture: GSS + GQA attention + FFN branches (docs/pha.md)."""
