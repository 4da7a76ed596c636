"""Export a tcal hybrid to a layout that serving engines run (:mod:`tcal.export.qwen3_5`), as a transformers
checkpoint or a llama.cpp GGUF."""
