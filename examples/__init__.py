"""The example GPT and its DeepSpeed training scripts (importable as ``examples.gpt``, ``examples.corpus``, ...)."""
